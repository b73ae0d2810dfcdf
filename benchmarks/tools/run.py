"""Tool calling on a real model: right answers out of N through each route (the engine's
``chat`` with the call forced and left to the model, LangChain's ``create_agent``,
LlamaIndex's ``FunctionAgent`` and ``ReActAgent``, a plain ``openai`` client against the
server, and the same loop on ``generate`` with the model's own template), over three tools
(``multiply``, ``order_status``, a lookup only the tool can answer, and ``get_weather``),
for each kind of task (one call, two calls in sequence, a call plus a retrieved passage).
Each agent step's reused share of its prompt is counted from step 2 on (steps the engine
answered). An exception is counted, not raised: the grammar must never crash a route.

    python -m benchmarks.tools --model qwen2.5-coder-0.5b-instruct --out docs/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks.common.records import write_record
from benchmarks.tools.routes import ROUTES, Outcome
from benchmarks.tools.tasks import KINDS
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive
from kvboost_rag.core.engine import KVBoost


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m benchmarks.tools", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", type=dtype_name)
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--limit", type=positive, default=None, help="the first N of each kind")
    parser.add_argument("--max-tokens", type=positive, default=96)
    parser.add_argument("--out", type=Path, default=None, help="folder for tools-<model>.json/.txt")
    return parser.parse_args(argv)


class Steps:
    """The engine's answers during one task, in order, read from ``chat`` and
    ``stream_chat`` (every route but ``generate``'s goes through one of them)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.answers: list[Callable[[], Any]] = []

    def __enter__(self) -> Steps:
        chat, stream_chat = self.engine.chat, self.engine.stream_chat

        def recorded_chat(*args: Any, **kwargs: Any) -> Any:
            result = chat(*args, **kwargs)
            self.answers.append(lambda: result)
            return result

        def recorded_stream(*args: Any, **kwargs: Any) -> Any:
            stream = stream_chat(*args, **kwargs)
            self.answers.append(lambda: stream.result)
            return stream

        self.engine.chat, self.engine.stream_chat = recorded_chat, recorded_stream
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.chat, self.engine.stream_chat  # the class's methods again

    def reused(self) -> list[float]:
        """Each answered step's reused share of its prompt (a stream cut short: none)."""
        results = [answer() for answer in self.answers]
        return [r.reused_tokens / max(r.prompt_tokens, 1) for r in results if r is not None]


def attempt(route: Any, engine: KVBoost, task: Any, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    with Steps(engine) if engine is not None else nullcontext() as steps:
        try:
            outcome, error = route(engine, task, max_tokens), None
        except Exception as caught:  # what broke is the finding
            outcome, error = Outcome(right=False), f"{type(caught).__name__}: {caught}"[:400]
    return {
        "question": task.question,
        "kind": task.kind,
        **dataclasses.asdict(outcome),
        "error": error,
        "seconds": round(time.perf_counter() - start, 1),
        "reused": [round(share, 3) for share in steps.reused()] if steps else [],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    routes: dict[str, Any] = {}
    for name in args.routes:
        for kind in args.kinds:
            tasks = KINDS[kind][: args.limit]
            records = []
            for task in tasks:
                records.append(attempt(ROUTES[name], engine, task, args.max_tokens))
                print(f"{name}: {json.dumps(records[-1])}", file=sys.stderr, flush=True)
            routes[f"{name}, {kind}"] = {"summary": summary(records, tasks), "tasks": records}
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
        **reuse_summary([share for r in records for share in r.get("reused", [])[1:]]),
    }


def reuse_summary(later: list[float]) -> dict[str, Any]:
    """Steps 2 and on: how many, how many reused >= 80% of their prompt, the least share."""
    return {
        "later_steps": len(later),
        "later_steps_80": sum(share >= 0.8 for share in later),
        "least_later_reuse": min(later) if later else None,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['model']} ({report['machine']['dtype']}, {report['machine']['cpu']})",
        "| route, tasks | right | right tool first | invalid calls | loop limit | errors "
        "| steps 2+ reusing >= 80% | least reuse, steps 2+ | median s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, data in report["routes"].items():
        s = data["summary"]
        least = s.get("least_later_reuse")
        later = f"{s['later_steps_80']}/{s['later_steps']}" if s.get("later_steps") else "-"
        lines.append(
            f"| {name} | {s['right']}/{s['tasks']} | {s['right_tool_first']}/{s['tasks']} "
            f"| {s['invalid_calls']} | {s['loop_limit']} | {s['errors']} | {later} "
            f"| {'-' if least is None else f'{least:.0%}'} | {s['median_seconds']} |"
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
