"""The fault table: one row per fault, then what the user saw and what each fault checked;
written as ``faults.txt`` (as printed) and ``faults.json`` (every number, every message)."""

from __future__ import annotations

import json
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from benchmarks.faults import lab as faults
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.core.store.remote import import_redis

HEADER = (
    f"{'fault':<24}{'raised':>7}{'warned':>7}{'logged':>7}{'served':>8}{'wrong':>6}"
    f"{'prefill':>8}{'TTFT p50':>9}{'max':>7}{'lookup':>7}"
    f"{'hits':>6}{'miss':>6}{'bad':>5}{'err':>5}{'skip':>6}{'writes':>7}"
)

LEGEND = [
    "raised: exceptions that reached the caller; warned: warnings, every one counted; "
    "logged: kvboost log lines",
    "served: requests completed / attempted; wrong: answers unlike the reference engine's "
    "(no shared tier) on the same route",
    "prefill: requests that fell back to a plain prefill (over half their passage tokens "
    "missing from every tier)",
    "TTFT p50 and max, lookup (the most one request spent reading the tiers) in ms",
    "hits..writes: shared-tier counters summed over the fault's engines (bad: values "
    "dropped as damaged)",
]


def report(lab: faults.Lab, rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    return {
        "model": faults.MODEL,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "redis_server": _server_version(),
        "redis_py": import_redis().__version__,
        "passages": len(lab.texts),
        "passages_per_prompt": faults.PER_PROMPT,
        "prompts_per_fault": len(lab.queries),
        "median_prompt_tokens": median([len(_tokens(lab, i)) for i in range(len(lab.queries))]),
        "new_tokens": faults.NEW_TOKENS,
        "remote_timeout_s": faults.TIMEOUT,
        "signed": lab.reference.config.secret() is not None,  # cache_secret / its env var
        "seconds": seconds,
        "rows": rows,
    }


def lines(rep: dict[str, Any]) -> list[str]:
    out = [
        f"Shared Redis tier under faults: {rep['model']} {rep['dtype']}, {rep['threads']} "
        f"threads, {rep['passages']} passages, {rep['prompts_per_fault']} prompts of "
        f"{rep['passages_per_prompt']} passages (median {rep['median_prompt_tokens']:.0f} "
        f"tokens) per fault, {rep['new_tokens']} greedy tokens, remote_timeout "
        f"{rep['remote_timeout_s']} s, entries {'' if rep['signed'] else 'not '}signed "
        f"(cache_secret), redis-server {rep['redis_server']}",
        "",
        HEADER,
    ]
    out += [_row(r) for r in rep["rows"]]
    out += ["", *LEGEND, "", "What the user saw, and what was checked:"]
    for r in rep["rows"]:
        notes = r["notes"] + [f"warm_corpus took {s:.1f} s" for s in r["warm_s"]]
        out += [f"- {r['fault']}: {_saw(r)}"] + [f"    {note}" for note in notes]
    out += ["", f"total {rep['seconds']:.0f} s"]
    return out


def write(out: Path, rep: dict[str, Any], name: str = "faults") -> None:
    text = lines(rep)
    print("\n".join(text))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text("\n".join(text) + "\n")
    (out / f"{name}.json").write_text(json.dumps(rep, indent=2))
    print(f"wrote {out / f'{name}.txt'} and {out / f'{name}.json'}")


def _row(r: dict[str, Any]) -> str:
    s = r["remote"]
    served = f"{r['completed']}/{r['attempted']}"
    return (
        f"{r['fault']:<24}{len(r['raised']):>7}{r['warnings']:>7}{len(r['logged']):>7}"
        f"{served:>8}{r['wrong']:>6}{r['prefilled']:>8}{_ms(r['median_ttft_ms']):>9}"
        f"{_ms(r['worst_ttft_ms']):>7}{_ms(r['worst_lookup_ms']):>7}{s['hits']:>6}"
        f"{s['misses']:>6}{s['corrupt']:>5}{s['errors']:>5}{s['skipped']:>6}{s['writes']:>7}"
    )


def _saw(r: dict[str, Any]) -> str:
    parts = [f"raised {_short(e)}" for e in r["raised"]]
    texts = r["warning_texts"]
    if texts:
        kinds = f" ({len(texts)} distinct)" if len(texts) > 1 else ""
        parts.append(f"{r['warnings']} warning(s){kinds}, first: {_short(texts[0])}")
    parts += [f"log: {_short(line)}" for line in dict.fromkeys(r["logged"])]
    return "; ".join(parts) or "nothing"


def _short(text: str, width: int = 150) -> str:
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = re.sub(r"(kvboost:)[0-9a-f]{32}:[0-9a-f]+", r"\1<fp>:<key>", text)
    return text if len(text) <= width else text[: width - 3] + "..."


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _tokens(lab: faults.Lab, i: int) -> list[int]:
    q = lab.queries[i]
    return lab.base.tokenize(q.question, passages=list(q.passages))


def _server_version() -> str:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    match = re.search(r"v=(\S+)", out)
    return match.group(1) if match else "?"
