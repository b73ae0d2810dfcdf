"""What starting an engine costs against transformers' own load of the same folder.

    .venv/bin/python scripts/startup_cost.py --model qwen2.5-coder-1.5b-instruct \\
        --dtype bfloat16 --runs 5 [--before DIR] [--out startup-cost.json]

Every start runs in a fresh Python process, timed inside it after the imports, and the
systems take turns run by run (their order rotating), so a slow minute of a shared machine
hits them all. The systems:

- ``transformers``: ``AutoTokenizer.from_pretrained`` + ``AutoModelForCausalLM.from_pretrained
  (folder, dtype=...)``, what the user's own code would do;
- ``kvboost-rag``: what ``KVBoost.from_pretrained(folder, dtype=...)`` does, timed in its two
  parts (transformers' load, then ``KVBoost(model, tokenizer)``: "engine s", what the
  engine adds), with this machine's measurements remembered (every start after the first;
  one start primes them);
- ``kvboost-rag, first start``: the same with ``remember_measurements=False``, which measures
  everything, as the first start on a machine does;
- ``kvboost-rag before`` (``--before DIR``): a site folder holding another version of the
  package (``kvboost_rag/`` with ``core/`` and ``integrations/`` inside it).

Each kvboost-rag start is followed by two one-token requests (their TTFT: the first pays
whatever first-use cost the start left). Prints a table (medians, min-max, the median of
each run's ratio to transformers' load in that run, and "x added": that load plus what the
engine added, over that load) and writes JSON. Waits before a start
while less memory than the model needs twice over (10 GiB at least; ``--min-free`` sets it)
is available: a page cache that cannot hold the model's file would time the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "Write a Python function that adds two numbers."
BASE = "transformers"


def child(system: str, folder: str, dtype: str) -> dict[str, Any]:
    """One start, in this (fresh) process: the imports its system needs (``import_s``), the
    other's imports untimed (so both load the same modules lazily inside the clock), then
    the load (``start_s``)."""
    start = time.perf_counter()
    if system == BASE:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    else:
        from kvboost_rag import KVBoost, KVBoostConfig
    out: dict[str, Any] = {"import_s": time.perf_counter() - start}
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvboost_rag
    from kvboost_rag import KVBoost, KVBoostConfig
    from kvboost_rag.core.model.loading import load_model

    start = time.perf_counter()
    if system == BASE:
        AutoTokenizer.from_pretrained(folder)
        AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
        out["start_s"] = time.perf_counter() - start
        return out
    first = system == "kvboost-rag, first start"  # the version before has no such field
    config = KVBoostConfig(remember_measurements=False) if first else KVBoostConfig()
    # What from_pretrained does for a folder, in its two parts: transformers' load (the
    # same calls as above) and the engine made on the loaded model.
    model, tokenizer = load_model(folder, getattr(torch, dtype), torch.device("cpu"))
    out["load_s"] = time.perf_counter() - start
    engine = KVBoost(model, tokenizer, config)
    out["start_s"] = time.perf_counter() - start
    out["engine_s"] = out["start_s"] - out["load_s"]
    out["ttft_ms"] = [engine.generate(PROMPT, max_new_tokens=1).ttft_ms for _ in range(2)]
    out["package"] = str(Path(kvboost_rag.__file__).parent)
    return out


def cpu() -> str:
    """The CPU's model name, its cores and the bf16 features that steer the engine."""
    from kvboost_rag.core.model.measurements import _cpu

    name, flags = _cpu()
    features = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in flags.split()]
    return f"{name}, {'/'.join(features[:2])}"


def available_gib() -> float:
    with open("/proc/meminfo") as info:
        fields = dict(line.split(":", 1) for line in info)
    return int(fields["MemAvailable"].split()[0]) / 2**20


def start(system: str, folder: str, dtype: str, site: str | None, need_gib: float) -> Any:
    while available_gib() < need_gib:
        print(f"  waiting: {available_gib():.1f} GiB available, {need_gib:.1f} needed", flush=True)
        time.sleep(20)
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site
    command = [sys.executable, os.path.abspath(__file__), "--child", system, folder, dtype]
    done = subprocess.run(  # run outside the repository: its folders shadow a given site
        command, env=env, cwd="/", capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{system} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    base = [r["start_s"] for r in runs[BASE]]
    for system, results in runs.items():
        starts = [r["start_s"] for r in results]
        ratios = [s / b for s, b in zip(starts, base)]
        # transformers' load in the same run plus what the engine added: the load's noise
        # (a page cache refilled, another process's burst) counted once
        added = [(b + r.get("engine_s", 0.0)) / b for r, b in zip(results, base)]
        first = [r["ttft_ms"][0] for r in results if "ttft_ms" in r]
        second = [r["ttft_ms"][1] for r in results if "ttft_ms" in r]
        rows.append(
            {
                "system": system,
                "start_s": statistics.median(starts),
                "min_s": min(starts),
                "max_s": max(starts),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "added_ratio": statistics.median(added),
                "added_min": min(added),
                "added_max": max(added),
                "import_s": statistics.median(r["import_s"] for r in results),
                "engine_s": statistics.median(r.get("engine_s", 0.0) for r in results),
                "first_ttft_ms": statistics.median(first) if first else None,
                "second_ttft_ms": statistics.median(second) if second else None,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    head = ("system", "start s", "min-max", "x transformers", "engine s", "x added", "TTFT 1/2")
    print(
        f"{head[0]:26} {head[1]:>7} {head[2]:>11} {head[3]:>17} {head[4]:>8} {head[5]:>17} "
        f"{head[6]:>13}"
    )
    for r in rows:
        spread = f"{r['min_s']:.2f}-{r['max_s']:.2f}"
        ratio = f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        ttft = ""
        if r["first_ttft_ms"] is not None:
            ttft = f"{r['first_ttft_ms']:.0f}/{r['second_ttft_ms']:.0f} ms"
        added = f"{r['added_ratio']:.2f} ({r['added_min']:.2f}-{r['added_max']:.2f})"
        line = f"{r['system']:26} {r['start_s']:7.2f} {spread:>11} {ratio:>17}"
        print(f"{line} {r['engine_s']:8.2f} {added:>17} {ttft:>13}")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(*sys.argv[2:5])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", help="a site folder with another version of the package")
    parser.add_argument("--min-free", type=float, help="GiB available to start a process")
    parser.add_argument("--out", type=Path, default=Path("startup-cost.json"))
    args = parser.parse_args()
    from kvboost_rag.core.model.loading import resolve_model_path

    folder = resolve_model_path(args.model)
    size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) / 2**30
    need = args.min_free or max(10.0, 2 * size * (0.5 if args.dtype == "bfloat16" else 1) + 1)
    systems = {BASE: None, "kvboost-rag": None, "kvboost-rag, first start": None}
    if args.before:
        systems["kvboost-rag before"] = args.before
    start("kvboost-rag", folder, args.dtype, None, need)  # primes the measurements
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    names = list(systems)
    for run in range(args.runs):
        order = names[run % len(names) :] + names[: run % len(names)]
        for name in order:
            runs[name].append(start(name, folder, args.dtype, systems[name], need))
            print(f"run {run + 1} {name}: {runs[name][-1]['start_s']:.2f} s", flush=True)
    rows = report(runs)
    title = f"{args.model} {args.dtype}, {args.runs} runs, {cpu()}"
    print_table(rows, title)
    payload = {"model": args.model, "dtype": args.dtype, "cpu": cpu(), "rows": rows}
    args.out.write_text(json.dumps(payload | {"runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
