"""Resident memory, start-up and conversion peak per weight kind, beside the GGUF's size.

    python -m benchmarks.weights [--models qwen2.5-coder-0.5b-instruct,...]
        [--weights gguf,dense,int8-dynamic,int4] [--out DIR]

Each measurement runs in a process of its own (``probe.py``), so one kind's memory never
counts in another's: ``KVBoost.from_pretrained(model, weights=...)`` started once, then
again in a new process (the one reported: converted checkpoint, packed blocks and
measurements on disk, as every start after the first), its resident set after the start
and a request (VmRSS, and how much of it is mapped from files) and its peak (VmHWM);
transformers' own ``AutoModelForCausalLM.from_pretrained`` of the same converted folder in
the same dtype, timed the same way (start-up's yardstick); the conversion of the GGUF into
a new cache root (GGUF to folder, then the first start with the default weights, and again
on the GGUF's blocks), whose peak is set against the result's size (its state dict) and
the resident set the start leaves (the result as the process holds it: packed copies,
mapped caches, the libraries); and the GGUF converted
into a folder alone (``kvboost-rag convert``: tensor by tensor), its peak beside the
process's resident set before it. Prints the table and writes ``weights-<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvboost_rag.bench.common.baseline import write_report
from kvboost_rag.cli.arguments import ArgumentParser

PROBE = Path(__file__).with_name("probe.py")
GIB = 2**30


def probe(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(PROBE), *args], capture_output=True, text=True, env=env, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(f"probe {args} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def record(model: str, kinds: list[str]) -> dict[str, Any]:
    rows = {kind: (probe("first", model, kind), probe("engine", model, kind))[1] for kind in kinds}
    rows["transformers"] = probe("transformers", model)
    with tempfile.TemporaryDirectory() as root:
        env = {**os.environ, "XDG_CACHE_HOME": root}
        conversion = probe("convert", model, env=env)
        converted = probe("folder", model, str(Path(root) / "folder"))
    with tempfile.TemporaryDirectory() as root:  # the first start on the GGUF's blocks
        on_blocks = probe("convert", model, "gguf", env={**os.environ, "XDG_CACHE_HOME": root})
    return {
        "command": "python -m benchmarks.weights " + " ".join(sys.argv[1:]),
        "model": model,
        "gguf_bytes": conversion["gguf_bytes"],
        "rows": rows,
        "conversion": conversion,
        "conversion_on_blocks": on_blocks,
        "folder": converted,
    }


def table(report: dict[str, Any]) -> str:
    gguf = report["gguf_bytes"]
    lines = [
        f"{report['model']}: GGUF {gguf / GIB:.2f} GiB",
        "| weights | start-up (s) | resident after start (GiB) | of it file-mapped | x GGUF "
        "| peak (GiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, row in report["rows"].items():
        lines.append(
            f"| {kind} | {row['start_s']:.1f} | {row['rss'] / GIB:.2f} | "
            f"{row.get('rss_file', 0) / GIB:.2f} | {row['rss'] / gguf:.2f} | "
            f"{row['peak'] / GIB:.2f} |"
        )
    for key, what in (("conversion", "the default"), ("conversion_on_blocks", "a blocks")):
        c = report[key]
        lines.append(
            f"conversion (GGUF -> folder -> {what} start, a new cache root): "
            f"{c['seconds']:.0f} s, peak {c['peak'] / GIB:.2f} GiB against a result of "
            f"{c['result_bytes'] / GIB:.2f} GiB ({c['peak'] / c['result_bytes']:.2f}x) and "
            f"the resident set it leaves, {c['rss'] / GIB:.2f} GiB "
            f"({c['peak'] / c['rss']:.2f}x); the process before it held "
            f"{c.get('start_rss', 0) / GIB:.2f} GiB"
        )
    f = report["folder"]
    lines.append(
        f"the GGUF to a folder alone (kvboost-rag convert): {f['seconds']:.0f} s, peak "
        f"{f['peak'] / GIB:.2f} GiB (the process before it: {f['start_rss'] / GIB:.2f}) for "
        f"{f['weights_bytes'] / GIB:.2f} GiB of float32 weights written"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m benchmarks.weights", description=__doc__)
    parser.add_argument("--models", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--weights", default="gguf,dense,int8-dynamic,int4")
    parser.add_argument("--out", type=Path, default=Path("docs/bench"))
    args: argparse.Namespace = parser.parse_args(argv)
    for model in args.models.split(","):
        report = record(model, args.weights.split(","))
        print(table(report))
        report["table"] = table(report)
        write_report(args.out, f"weights-{model}.json", report)


if __name__ == "__main__":
    main()
