"""What a ``stop`` costs a request: the same short chat answers with and without stop
strings, one after the other on one engine, and building the stop matcher alone (it reads
the tokenizer's whole vocabulary). Run it on two commits, one after the other, to compare.

    python -m benchmarks.stops --model qwen2.5-coder-0.5b-instruct --out /tmp/stops

Issue 64's run (2-core AMD EPYC, bf16): a stop added 607 ms to an 8-token answer when the
matcher was built twice a request, 15 ms once built once per stop set
(``docs/bench/stops-qwen2.5-coder-0.5b-instruct-{before,after}.txt``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from transformers import StopStringCriteria

from benchmarks.common.records import write_record
from kvboost_rag import KVBoost
from kvboost_rag.bench.common.systems import machine

STOPS = ["\n\nQuestion:", "</answer>"]
ASK = [{"role": "user", "content": "Name three rivers of France, briefly."}]


def timed_ms(call: Any) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = KVBoost.from_pretrained(args.model)
    engine.chat(ASK, max_new_tokens=args.max_tokens)  # warm the prompt's prefix and kernels
    rows: dict[str, list[float]] = {"no stop": [], "stop": []}
    for _ in range(args.requests):  # interleaved, so drift touches both alike
        rows["no stop"].append(timed_ms(lambda: engine.chat(ASK, max_new_tokens=args.max_tokens)))
        rows["stop"].append(
            timed_ms(lambda: engine.chat(ASK, max_new_tokens=args.max_tokens, stop=STOPS))
        )
    build = [timed_ms(lambda: StopStringCriteria(engine.tokenizer, STOPS)) for _ in range(3)]
    medians = {name: statistics.median(ms) for name, ms in rows.items()}
    lines = [
        f"{args.model}: {args.requests} chat requests each, {args.max_tokens} new tokens",
        "| request | median ms | ms each |",
        "|---|---:|---:|",
        *(
            f"| {name} | {medians[name]:.0f} | {' '.join(f'{x:.0f}' for x in ms)} |"
            for name, ms in rows.items()
        ),
        f"stop adds {medians['stop'] - medians['no stop']:.0f} ms a request; "
        f"building the matcher alone: {statistics.median(build):.0f} ms "
        f"(vocabulary {len(engine.tokenizer)})",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        report = {"model": args.model, "machine": machine(engine), "ms": rows, "build_ms": build}
        write_record(args.out, f"stops-{args.model}", report, text)


if __name__ == "__main__":
    main()
