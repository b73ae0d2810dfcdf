"""The Berkeley Function Calling Leaderboard's questions through ``chat(tools=)``, beside
transformers' ``generate`` on the same model with the model's own chat template and a plain
parser (``<tool_call>`` tags, bare or fenced JSON), both scored by the leaderboard's AST
checker. Both arms may write several calls (OpenAI's ``parallel_tool_calls`` default).

    pip install --no-deps bfcl-eval==2026.3.23
    python -m benchmarks.bfcl --model qwen2.5-coder-0.5b-instruct --limit 50 --out docs/bench
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bfcl.questions import CATEGORIES, Question, load, right
from benchmarks.common.plain import Calls, plain_answer
from benchmarks.common.records import write_record
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive
from kvboost_rag.core.engine import KVBoost


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m benchmarks.bfcl", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", type=dtype_name)
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    parser.add_argument("--limit", type=positive, default=25, help="the first N per category")
    parser.add_argument("--max-tokens", type=positive, default=160)
    parser.add_argument("--out", type=Path, default=None, help="folder for bfcl-<model>.json/.txt")
    return parser.parse_args(argv)


def engine_calls(engine: KVBoost, question: Question, max_tokens: int) -> Calls:
    result = engine.chat(
        question.messages, tools=question.tools, parallel_tool_calls=True, max_new_tokens=max_tokens
    )
    return [(c.name, c.arguments) for c in result.tool_calls]


def generate_calls(engine: KVBoost, question: Question, max_tokens: int) -> Calls:
    """The model alone: its template, greedy ``generate``, and a plain parser."""
    return plain_answer(engine, question.messages, question.tools, max_tokens)[1]


ARMS = {"chat(tools=)": engine_calls, "generate": generate_calls}


def attempt(arm: Any, engine: KVBoost, question: Question, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        calls, error = arm(engine, question, max_tokens), None
    except Exception as caught:  # an exception is a finding, counted
        calls, error = [], f"{type(caught).__name__}: {caught}"[:300]
    return {
        "id": question.id,
        "right": error is None and right(question, calls),
        "calls": calls,
        "error": error,
        "seconds": round(time.perf_counter() - start, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    categories: dict[str, Any] = {}
    for category in args.categories:
        questions = load(category, args.limit)
        arms: dict[str, Any] = {}
        for name, arm in ARMS.items():
            records = [attempt(arm, engine, q, args.max_tokens) for q in questions]
            arms[name] = {
                "right": sum(r["right"] for r in records),
                "errors": sum(r["error"] is not None for r in records),
                "records": records,
            }
            print(f"{category} {name}: {arms[name]['right']}/{len(records)}", file=sys.stderr)
        categories[category] = {"questions": len(questions), "arms": arms}
    return {
        "model": args.model,
        "machine": machine(engine),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "categories": categories,
    }


def table(report: dict[str, Any]) -> str:
    names = list(ARMS)
    lines = [
        f"{report['model']} ({report['machine']['dtype']}, {report['machine']['cpu']})",
        "| category | " + " | ".join(f"{n} right (errors)" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for category, data in report["categories"].items():
        cells = [
            f"{data['arms'][n]['right']}/{data['questions']} ({data['arms'][n]['errors']})"
            for n in names
        ]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    text = table(report)
    print(text)
    if args.out is not None:
        write_record(args.out, f"bfcl-{args.model}", report, text)


if __name__ == "__main__":
    main()
