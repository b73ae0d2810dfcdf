"""What finding passages without markers costs: the passage index at 1k, 10k and 100k
stored passages.

    .venv/bin/python scripts/index_cost.py [--sizes 1000,10000,100000] [--prompts 200] \\
        [--out docs/bench/index-cost.json]

Passages are 150-250 token ids drawn from Qwen2.5's vocabulary size (151,646), as a corpus
chunked at ~200 tokens is; each prompt is ~1,000 tokens: 4 stored passages in random
order, one stored passage cut after 60 tokens, one unknown passage, and short filler text
between them. Per size it prints and writes: the index's memory per passage (tracemalloc's
count of what adding the passages allocated), the time to add one, and the time per prompt
of ``PassageIndex.find`` (median, p90, max), with how many of the stored passages each
prompt held were found. One process, one core's worth of Python: no model runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

from kvboost_rag.core.reuse.index import PassageIndex

VOCAB = 151_646


def passage(rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(150, 250))]


def prompt(rng: random.Random, stored: list[list[int]]) -> tuple[list[int], int]:
    """~1,000 tokens holding 4 stored passages whole, one cut, one unknown; how many stored
    passages it holds."""
    parts = [*rng.sample(stored, 5), passage(rng)]
    parts[4] = parts[4][:60]
    rng.shuffle(parts)
    tokens: list[int] = [rng.randrange(VOCAB) for _ in range(20)]
    for part in parts:
        tokens += part + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))]
    return tokens, 5


def measure(size: int, prompts: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    corpus = [passage(rng) for _ in range(size)]
    index = PassageIndex(max_passages=max(size, 1))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    for tokens in corpus:
        index.add(tokens)
    add_s = time.perf_counter() - start
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    times, found = [], []
    for _ in range(prompts):
        tokens, holds = prompt(rng, corpus)
        start = time.perf_counter()
        placed = index.find(tokens)
        times.append((time.perf_counter() - start) * 1e3)
        found.append(len(placed) / holds)
    times.sort()
    return {
        "passages": size,
        "bytes_per_passage": held / size,
        "add_us": add_s / size * 1e6,
        "find_ms_median": statistics.median(times),
        "find_ms_p90": times[int(0.9 * (len(times) - 1))],
        "find_ms_max": times[-1],
        "prompt_tokens": len(tokens),
        "found_share": statistics.mean(found),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("index-cost.json"))
    args = parser.parse_args()
    rows = [measure(int(n), args.prompts, args.seed) for n in args.sizes.split(",")]
    print(
        f"{'passages':>9} {'B/passage':>10} {'add µs':>7} {'find ms p50':>11} "
        f"{'p90':>6} {'max':>6} {'found':>6}"
    )
    for r in rows:
        print(
            f"{r['passages']:>9,} {r['bytes_per_passage']:>10,.0f} {r['add_us']:>7.1f} "
            f"{r['find_ms_median']:>11.3f} {r['find_ms_p90']:>6.3f} {r['find_ms_max']:>6.3f} "
            f"{r['found_share']:>6.0%}"
        )
    report = {
        "command": "scripts/index_cost.py "
        + " ".join(f"--{k} {v}" for k, v in (("sizes", args.sizes), ("prompts", args.prompts))),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
