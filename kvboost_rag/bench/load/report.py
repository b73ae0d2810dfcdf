"""The summary, table and chart of ``bench.load``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvboost_rag.bench.common.chart import save
from kvboost_rag.bench.common.metrics import median, p90

SERIAL = "serialized"
NOTES = [
    "N requests start together; tokens/s and requests/s: all generated tokens (requests) "
    "over the time from the first start to the last end, summed over rounds.",
    "TTFT: call to first streamed text delta; TTLT: call to the end. HuggingFacePipeline "
    "cannot stream a batch: its TTFT is its TTLT.",
    "Generated tokens: the engines' token ids (an EOS they stopped at included); "
    "HuggingFacePipeline: its answer text re-tokenized (an EOS not counted).",
    "Decode tokens/s: the tokens after each request's first over the time the model spent "
    "decoding them: the batched engine's time in batch steps (its batcher's stats), the "
    "serialized engine's first-token-to-end spans (it holds the model through a whole "
    "decode). Context building (lookup, repair, first token) is left out for both.",
    "Same answers: token ids equal to the serialized engine's for the same request (the "
    "pipeline: equal text). The pipeline prefills every prompt in full while both engines "
    "reuse passage KV at the fidelity shown, so its answers may differ by design.",
]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, level), rounds pooled; speed-up against the serialized row."""
    keys = list(dict.fromkeys((r["system"], r["level"]) for r in runs))
    rows = [
        _row(name, level, [r for r in runs if (r["system"], r["level"]) == (name, level)])
        for name, level in keys
    ]
    serial = {r["level"]: r for r in rows if r["system"] == SERIAL}
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / serial[row["level"]]["tokens_per_s"]
        own, base = row["decode_tokens_per_s"], serial[row["level"]]["decode_tokens_per_s"]
        row["decode_speedup"] = own / base if own is not None and base else None
    return rows


def decode_time(runs: list[dict[str, Any]]) -> tuple[int, float]:
    """Tokens decoded after each request's first, and the seconds the model spent on them:
    the batcher's own step time where it decoded in batches, else the time some request
    was decoding (one request at a time holds the model through its whole decode)."""
    steps = [r.get("steps") for r in runs]
    if all(s and s["steps"] for s in steps):
        return sum(s["rows"] for s in steps), sum(s["seconds"] for s in steps)  # type: ignore[index]
    tokens = sum(max(q["tokens"] - 1, 0) for r in runs for q in r["requests"])
    return tokens, sum(decoding_seconds(r["requests"]) for r in runs)


def decoding_seconds(requests: list[dict[str, Any]]) -> float:
    """Seconds in which at least one request was decoding (past its first token)."""
    spans = sorted((q["start_ms"] + q["ttft_ms"], q["end_ms"]) for q in requests)
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total / 1e3


def _row(system: str, level: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    requests = [q for r in runs for q in r["requests"]]
    seconds = sum(max(q["end_ms"] for q in r["requests"]) for r in runs) / 1e3
    tokens = sum(q["tokens"] for q in requests)
    decoded, decoding = decode_time(runs)
    ttft, ttlt = [q["ttft_ms"] for q in requests], [q["ttlt_ms"] for q in requests]
    return {
        "system": system,
        "level": level,
        "requests": len(requests),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "requests_per_s": len(requests) / seconds,
        # None where nothing streamed (the pipeline): its decoding cannot be told apart
        "decode_tokens_per_s": decoded / decoding if decoding else None,
        "ttft_p50_ms": median(ttft),
        "ttft_p90_ms": p90(ttft),
        "ttlt_p50_ms": median(ttlt),
        "ttlt_p90_ms": p90(ttlt),
        "same_answers": sum(q["same_as_serialized"] for q in requests),
    }


def table(report: dict[str, Any]) -> str:
    """The report as a markdown table with what it ran on above and the notes below."""
    lines = [_header(report), ""]
    lines.append(
        "| system | N | tokens/s | decode tokens/s | requests/s | TTFT p50 ms | TTFT p90 ms "
        "| TTLT p50 ms | TTLT p90 ms | vs serialized: tokens/s, decode | same answers |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in sorted(report["rows"], key=lambda r: (r["level"], _order(report, r["system"]))):
        lines.append(
            f"| {row['system']} | {row['level']} | {row['tokens_per_s']:.1f} "
            f"| {_num(row['decode_tokens_per_s'], '.1f')} | {row['requests_per_s']:.2f} "
            f"| {row['ttft_p50_ms']:.0f} | {row['ttft_p90_ms']:.0f} "
            f"| {row['ttlt_p50_ms']:.0f} | {row['ttlt_p90_ms']:.0f} "
            f"| {row['speedup']:.2f}x, {_num(row['decode_speedup'], '.2f', 'x')} "
            f"| {row['same_answers']}/{row['requests']} |"
        )
    return "\n".join(lines + [""] + [f"- {n}" for n in NOTES])


def _num(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def _order(report: dict[str, Any], system: str) -> int:
    return list(dict.fromkeys(r["system"] for r in report["rows"])).index(system)


def _header(report: dict[str, Any]) -> str:
    m, s, warm, load = (report[k] for k in ("machine", "settings", "warm", "load_average"))
    return (
        f"{report['model']} {m['dtype']} on {m['cpu']} ({m['cpu_count']} cores, "
        f"{m['threads']} torch threads); fidelity {s['fidelity']}; each request {s['k']} "
        f"passages of a {s['passages']}-passage corpus and its own question, greedy, at most "
        f"{s['max_new_tokens']} new tokens; {s['rounds']} round(s) per level. batched: "
        f"max_batch_size={warm['batched']['max_batch_size']}; serialized: max_batch_size=1; "
        f"each engine warmed its own cache ({warm['batched']['seconds']:.1f} s / "
        f"{warm['serialized']['seconds']:.1f} s, not timed). Load average "
        f"{load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end; "
        f"{report['seconds'] / 60:.1f} min. Command: {report['command']}"
    )


def draw(report: dict[str, Any], path: Path) -> Path:
    """Write ``path`` (PNG): aggregate tokens/s and p90 TTLT against N, one line per
    system. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("the chart needs: pip install 'kvboost-rag[examples]'") from err
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system in dict.fromkeys(r["system"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["system"] == system]
        levels = [r["level"] for r in rows]
        left.plot(levels, [r["tokens_per_s"] for r in rows], "o-", label=system)
        right.plot(levels, [r["ttlt_p90_ms"] / 1e3 for r in rows], "o-", label=system)
    for ax, label in (
        (left, "aggregate generated tokens/s"),
        (right, "p90 time to last token (s)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["settings"]["levels"], [str(n) for n in report["settings"]["levels"]])
        ax.set_xlabel("concurrent requests N")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend()
    return save(fig, report, path)
