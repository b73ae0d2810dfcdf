"""The next request's TTFT right after a cold prompt, against the same on an idle engine.

    .venv/bin/python scripts/deferred_yield.py --model qwen2.5-coder-0.5b-instruct \\
        --dtype bfloat16 --pairs 6 [--fidelity balanced] [--cache-dir DIR] [--out FILE]

A cold prompt (4 passages no request has seen, in the fact-retrieval chat layout) is
prefilled plainly and its passages are encoded after its answer, for the next prompt that
holds them ("deferred"). The next request asks about 4 passages warmed beforehand
(``warm_passages(prefix=)``), as a retriever's next query would. Each pair runs two
sequences on one engine, in alternating order:

- ``after a cold prompt``: the cold prompt's answer, then at once the next request (timed),
  then ``flush()`` (timed: the deferred work left);
- ``idle``: the cold prompt's answer, ``flush()``, then the next request (timed).

Every cold prompt has passages of its own; the two next requests of a pair ask different
questions over different warmed passages, swapped between the sequences pair by pair.
Prints a table (medians, min-max, the median of each pair's ratio) and writes JSON. Works
with another version of the package on ``PYTHONPATH`` (run it from outside the repository)
to compare before and after.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

WARMED, COLD_PER_PROMPT = 16, 4


def sequences(engine: Any, cold: list[Any], after: Any, busy: bool, answer: int) -> dict:
    from kvboost_rag.bench.common.corpus import messages_for

    first = engine.chat(messages_for(cold, cold[0].question), max_new_tokens=answer)
    assert first.passages_hit == 0, "the cold prompt found cached passages"
    flushed = 0.0
    if not busy:
        start = time.perf_counter()
        engine.flush()
        flushed = time.perf_counter() - start
    nxt = engine.chat(messages_for(after, after[1].question), max_new_tokens=1)
    start = time.perf_counter()
    engine.flush()
    left = time.perf_counter() - start
    return {
        "ttft_ms": nxt.ttft_ms,
        "wait_ms": nxt.timings.wait_ms,
        "lookup_ms": nxt.timings.lookup_ms,
        "hits": nxt.passages_hit,
        "cold_answer_ms": first.total_ms,
        "flush_before_s": flushed,
        "flush_after_s": left,
    }


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--fidelity", default="balanced", choices=["balanced", "fast"])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--answer", type=int, default=16, help="the cold prompt's answer tokens")
    parser.add_argument("--tokens", type=int, default=180, help="tokens a passage")
    parser.add_argument("--cache-dir", help="a disk tier: the deferred encodes' writes too")
    parser.add_argument("--out", type=Path, default=Path("deferred-yield.json"))
    args = parser.parse_args()
    import kvboost_rag
    from kvboost_rag import KVBoost, KVBoostConfig
    from kvboost_rag.bench.common.corpus import fact_passages, passages, warm_prefix
    from kvboost_rag.bench.common.systems import machine

    config = KVBoostConfig(fidelity=args.fidelity, cache_dir=args.cache_dir)
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype, config=config)
    count = WARMED + 2 * args.pairs * COLD_PER_PROMPT + 1
    pool = fact_passages(passages(engine.tokenizer, args.tokens, count), 0)
    warmed, cold = pool[:WARMED], pool[WARMED:]
    engine.warm_passages([p.text for p in warmed], prefix=warm_prefix())
    rng = random.Random(0)
    sequences(engine, cold[-1:], rng.sample(warmed, 4), True, args.answer)  # first-use costs
    runs: dict[str, list[dict]] = {"after a cold prompt": [], "idle": []}
    for pair in range(args.pairs):
        nexts = [rng.sample(warmed, 4), rng.sample(warmed, 4)]
        order = [True, False] if pair % 2 == 0 else [False, True]
        for i, busy in enumerate(order):
            chunk = cold[(2 * pair + i) * COLD_PER_PROMPT :][:COLD_PER_PROMPT]
            after = nexts[(i + pair) % 2]
            name = "after a cold prompt" if busy else "idle"
            runs[name].append(sequences(engine, chunk, after, busy, args.answer))
            print(f"pair {pair + 1} {name}: {runs[name][-1]['ttft_ms']:.0f} ms", flush=True)
    busy, idle = runs["after a cold prompt"], runs["idle"]
    ratios = [b["ttft_ms"] / i["ttft_ms"] for b, i in zip(busy, idle)]
    info = machine(engine)
    print(f"\n{args.model} {args.dtype} {args.fidelity}, {args.pairs} pairs, {info['cpu']}")
    print(f"package: {Path(kvboost_rag.__file__).parent}")
    head = ("next request", "TTFT ms", "min-max", "wait ms", "flush after s")
    print(f"{head[0]:22} {head[1]:>9} {head[2]:>13} {head[3]:>8} {head[4]:>14}")
    for name, rows in runs.items():
        t = summary([r["ttft_ms"] for r in rows])
        wait = statistics.median(r["wait_ms"] for r in rows)
        left = statistics.median(r["flush_after_s"] for r in rows)
        spread = f"{t['min']:.0f}-{t['max']:.0f}"
        print(f"{name:22} {t['median']:9.0f} {spread:>13} {wait:8.0f} {left:14.2f}")
    r = summary(ratios)
    print(f"pairs' TTFT ratio (after / idle): {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})")
    preempted = getattr(engine._handle.executor, "preempted", None)
    print(f"background forwards dropped for a request: {preempted}")
    payload = {"args": vars(args) | {"out": str(args.out)}, "machine": info, "runs": runs}
    payload |= {"ratio": r, "preempted": preempted, "package": kvboost_rag.__file__}
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
