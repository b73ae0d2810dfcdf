"""Repairs for the case ``fast`` loses most: the answer's passage first of four.

    .venv/bin/python scripts/answer_first.py [--queries 24] [--position 0] [--options cheap]

The front's fact task (``benchmarks.front``): 4 passages of a 30-passage pool, the
passage holding the answer moved to ``--position``, SmolLM2-135M at the engine's dtype,
every option answering each prompt right after a full prefill of the same tokens. Beside
the registered repairs it tries two that are defined here only, because they measured no
better (docs/bench/fidelity.md, "The answer's passage first"):

- ``tail``: the question's top 3% (probe over 4 layers) plus the last ``edge_tokens``
  reused tokens, the ones the question reads through in a full prefill;
- ``later``: the same top 3% plus the first ``edge_tokens`` tokens of every passage after
  the first, the ones that in a full prefill first see the answer's passage.

``--options deviation`` runs CacheBlend's deviation (the values of layer 1 or 2; 6, 15 and
25%) beside no repair and ``balanced``'s query probe instead. (Layer 0's KV cannot deviate: it
is the token's embedding at its position, so a 1-layer deviation picks noise.) Prints
each option's line of the front's numbers.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from benchmarks.front import tasks
from benchmarks.front.measure import lines, measure, warm_up
from benchmarks.front.run import PASSAGE_TOKENS, passages
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common import systems
from kvboost_rag.core.reuse import repair


def choose_tail(plan: repair.RepairPlan, settings: repair.RepairSettings, model: Any) -> list[int]:
    reused = [p for start, end in plan.spans for p in range(start, end)]
    chosen = repair.choose_query(plan, settings, model)
    return sorted(set(chosen) | set(reused[-settings.edge_tokens :]))


def choose_later(plan: repair.RepairPlan, settings: repair.RepairSettings, model: Any) -> list[int]:
    k = settings.edge_tokens
    starts = [p for start, end in plan.spans[1:] for p in range(start, min(end, start + k))]
    return sorted(set(repair.choose_query(plan, settings, model)) | set(starts))


SMALL = {"recompute_ratio": 0.03, "probe_layers": 4}
OPTIONS: dict[str, dict[str, Any]] = {
    "none": {"fidelity": "fast", "repair": "none"},
    "query r=.15 L=8": {"repair": "query", "recompute_ratio": 0.15, "probe_layers": 8},
    "deviation r=.15": {"repair": "deviation", "recompute_ratio": 0.15},
    "tail64 +q.03L4": {"repair": "tail", "edge_tokens": 64} | SMALL,
    "tail128 +q.03L4": {"repair": "tail", "edge_tokens": 128} | SMALL,
    "later16 +q.03L4": {"repair": "later", "edge_tokens": 16} | SMALL,
    "passage r=.30": {"repair": "passage", "recompute_ratio": 0.30},
}  # fmt: skip
DEVIATION: dict[str, dict[str, Any]] = {
    "none": {"fidelity": "fast", "repair": "none"},
    "deviation r=.15 L=2": {"repair": "deviation", "recompute_ratio": 0.15, "probe_layers": 2},
    "deviation r=.06 L=2": {"repair": "deviation", "recompute_ratio": 0.06, "probe_layers": 2},
    "deviation r=.25 L=2": {"repair": "deviation", "recompute_ratio": 0.25, "probe_layers": 2},
    "deviation r=.15 L=3": {"repair": "deviation", "recompute_ratio": 0.15, "probe_layers": 3},
    "query r=.15 L=8": {"repair": "query", "recompute_ratio": 0.15, "probe_layers": 8},
}
SETS = {"cheap": OPTIONS, "deviation": DEVIATION}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=24)
    parser.add_argument("--position", type=int, default=0, choices=range(4))
    parser.add_argument("--options", choices=sorted(SETS), default="cheap")
    args = parser.parse_args()
    repair.STRATEGIES |= {"tail": choose_tail, "later": choose_later}
    base = KVBoost.from_pretrained("smollm2-135m-instruct", config=KVBoostConfig(fidelity="exact"))
    engines = {
        name: KVBoost(base.model, base.tokenizer, KVBoostConfig(**config))
        for name, config in SETS[args.options].items()
    }
    warm_up(base, engines)  # empties every cache when done: before the warming
    low, high = PASSAGE_TOKENS
    texts = random.Random(7).sample(passages(base.tokenizer, high, 48, min_tokens=low), 30)
    queries, pool, _ = tasks.batch("fact", texts, 4, args.queries, 11, None)
    queries = [tasks.at(q, args.position) for q in queries]
    systems.warm(engines, pool, tasks.warm_prefix(base.tokenizer, "fact", "format_passages"))
    prompts = [tasks.prompt(base.tokenizer, "fact", "format_passages", q) for q in queries]
    where = ["first" if args.position == 0 else "other"] * len(queries)
    rows = measure(base, engines, prompts, [q.answer for q in queries], 16, where)
    print(systems.machine(base)["cpu"])
    for name, line in lines(rows).items():
        numbers = {k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}
        print(f"{name:18s}", numbers)


if __name__ == "__main__":
    main()
