"""Tool calling on a real model: right answers out of N through each route (the engine's
``chat`` with the call forced and left to the model, LangChain's ``create_agent`` and
LlamaIndex's ``FunctionAgent``), over three tools (``multiply``, ``order_status``, a lookup
only the tool can answer, and ``get_weather``). An exception is counted, not raised: the
grammar must never crash a route.

    python -m benchmarks.tools --model qwen2.5-coder-0.5b-instruct --out docs/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.records import write_record
from benchmarks.tools.routes import ROUTES, Outcome
from benchmarks.tools.tasks import TASKS
from kvboost_rag.arguments import ArgumentParser, dtype_name, positive
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.core.engine import KVBoost


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m benchmarks.tools", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", type=dtype_name)
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
    parser.add_argument("--limit", type=positive, default=None, help="the first N tasks")
    parser.add_argument("--max-tokens", type=positive, default=96)
    parser.add_argument("--out", type=Path, default=None, help="folder for tools-<model>.json/.txt")
    return parser.parse_args(argv)


def attempt(route: Any, engine: KVBoost, task: Any, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        outcome, error = route(engine, task, max_tokens), None
    except Exception as caught:  # what broke is the finding
        outcome, error = Outcome(right=False), f"{type(caught).__name__}: {caught}"[:400]
    return {
        "question": task.question,
        **dataclasses.asdict(outcome),
        "error": error,
        "seconds": round(time.perf_counter() - start, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    tasks = TASKS[: args.limit]
    routes: dict[str, Any] = {}
    for name in args.routes:
        records = []
        for task in tasks:
            records.append(attempt(ROUTES[name], engine, task, args.max_tokens))
            print(f"{name}: {json.dumps(records[-1])}", file=sys.stderr, flush=True)
        routes[name] = {"summary": summary(records, tasks), "tasks": records}
    return {
        "model": args.model,
        "machine": machine(engine),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "routes": routes,
    }


def summary(records: list[dict[str, Any]], tasks: Any) -> dict[str, Any]:
    used = [r["tools_run"][:1] == [t.tool] for r, t in zip(records, tasks)]
    return {
        "tasks": len(records),
        "right": sum(r["right"] for r in records),
        "right_tool_first": sum(used),
        "invalid_calls": sum(r["invalid"] for r in records),
        "loop_limit": sum(r.get("limited", False) for r in records),
        "errors": sum(r["error"] is not None for r in records),
        "median_seconds": sorted(r["seconds"] for r in records)[len(records) // 2],
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['model']} ({report['machine']['dtype']}, {report['machine']['cpu']})",
        "| route | right | right tool first | invalid calls | loop limit | errors | median s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, data in report["routes"].items():
        s = data["summary"]
        lines.append(
            f"| {name} | {s['right']}/{s['tasks']} | {s['right_tool_first']}/{s['tasks']} "
            f"| {s['invalid_calls']} | {s['loop_limit']} | {s['errors']} | {s['median_seconds']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    text = table(report)
    print(text)
    if args.out is not None:
        write_record(args.out, f"tools-{args.model}", report, text)


if __name__ == "__main__":
    main()
