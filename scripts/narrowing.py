"""Does CacheBlend's layer-by-layer narrowing keep more answers than a flat ratio?

    .venv/bin/python scripts/narrowing.py [--queries 32]

Narrowing recomputes the chosen tokens in the first layers and only the top of them (by
deviation) in later ones, so it costs the *average* ratio over layers. Before building a
narrowed forward, this measures what one would answer, exactly: from layer ``k`` on, each
chosen token ranked below the narrower ratio keeps its cached keys and values (its fresh
ones are replaced before the layer writes them). That is what a narrowed forward computes:
a token it stops computing affects the others only through its KV, which stays cached. The
narrowed schedules run beside flat ratios of the same average cost; timing is not measured
(the forward still computes every chosen token), the cost column is the average ratio.

The front's fact task (``benchmarks.front``): 4 passages of a 30-passage pool, the
answer's passage at position ``i % 4`` for question ``i``, SmolLM2-135M at the engine's
dtype, every passage warmed; each option answers right after a full prefill of the same
tokens. Prints each option's numbers (docs/bench/fidelity.md, "Layer narrowing").
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.front import tasks
from benchmarks.front.measure import lines, measure, place, warm_up
from benchmarks.front.run import PASSAGE_TOKENS, passages
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common import systems
from kvboost_rag.core.generation.slots import SlotLayer
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.reuse import repair

Schedule = Callable[[int, int], float]  # (layer, layers) -> ratio recomputed at that layer
# The last repair's chosen tokens, most deviating first, and its schedule.
LAST: dict[str, Any] = {"ranked": [], "reused": 0, "schedule": None}


def flat(ratio: float) -> Schedule:
    return lambda layer, layers: ratio


def step(first: float, later: float, at: int) -> Schedule:
    return lambda layer, layers: first if layer < at else later


def linear(first: float, last: float) -> Schedule:
    """CacheBlend's gradual filtering: from ``first`` at layer 1 to ``last`` at the top."""
    return lambda layer, layers: first + (last - first) * max(layer - 1, 0) / (layers - 2)


SCHEDULES: dict[str, tuple[float, Schedule]] = {
    "flat .25 (balanced)": (0.25, flat(0.25)),
    "flat .20": (0.20, flat(0.20)),
    "flat .15": (0.15, flat(0.15)),
    "narrow .25->.15 @15": (0.25, step(0.25, 0.15, 15)),
    "narrow .25->.10 @8": (0.25, step(0.25, 0.10, 8)),
    "linear .25->.05": (0.25, linear(0.25, 0.05)),
    "linear .30->.10": (0.30, linear(0.30, 0.10)),
}


def ranked_deviation(schedule: Schedule) -> repair.Strategy:
    def choose(plan: repair.RepairPlan, settings: repair.RepairSettings, model: Any) -> list[int]:
        chosen = repair.choose_deviation(plan, settings, model)  # most deviating first
        LAST.update(ranked=chosen, reused=plan.reused_tokens, schedule=schedule)
        return chosen

    return choose


def no_repair(plan: repair.RepairPlan, settings: repair.RepairSettings, model: Any) -> list[int]:
    """``fast``'s repair, which also ends the last schedule: its forward narrows nothing."""
    LAST.update(ranked=[], reused=0, schedule=None)
    return []


def narrowed_update(original: Callable[..., Any]) -> Callable[..., Any]:
    """``SlotLayer.update`` where a repair pass's dropped tokens keep their cached KV."""

    def update(
        self: SlotLayer, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kw: Any
    ) -> Any:
        write, schedule = self._cache.current, LAST["schedule"]
        if schedule is None or write is None or write.columns is None or self.buffers is None:
            return original(self, keys, values, *args, **kw)
        layers = self._cache.layers
        keep = round(schedule(layers.index(self), len(layers)) * LAST["reused"])
        columns = write.columns[0]
        dropped = torch.isin(columns, torch.tensor(LAST["ranked"][keep:], dtype=torch.long))
        where = dropped.nonzero().flatten()
        if len(where) and isinstance(write.rows, slice):
            row = write.rows.start
            keys, values = keys.clone(), values.clone()
            keys[0, :, where] = self.buffers[0][row, :, columns[where]]
            values[0, :, where] = self.buffers[1][row, :, columns[where]]
        return original(self, keys, values, *args, **kw)

    return update


def average(schedule: Schedule, layers: int) -> float:
    return sum(schedule(layer, layers) for layer in range(layers)) / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=32)
    args = parser.parse_args()
    SlotLayer.update = narrowed_update(SlotLayer.update)  # type: ignore[method-assign]
    base = KVBoost.from_pretrained("smollm2-135m-instruct", config=KVBoostConfig(fidelity="exact"))
    repair.STRATEGIES["narrowing_none"] = no_repair
    none = KVBoostConfig(repair="narrowing_none")  # ``fast``: nothing repaired
    engines = {"none (fast)": KVBoost(base.model, base.tokenizer, none)}
    for i, (name, (ratio, schedule)) in enumerate(SCHEDULES.items()):
        repair.STRATEGIES[f"narrowing{i}"] = ranked_deviation(schedule)
        config = KVBoostConfig(repair=f"narrowing{i}", recompute_ratio=ratio, probe_layers=2)
        engines[name] = KVBoost(base.model, base.tokenizer, config)
    warm_up(base, engines)  # empties every cache when done: before the warming
    low, high = PASSAGE_TOKENS
    texts = random.Random(7).sample(passages(base.tokenizer, high, 48, min_tokens=low), 30)
    queries, pool, _ = tasks.batch("fact", texts, 4, args.queries, 11, None, cycle=True)
    systems.warm(engines, pool, tasks.warm_prefix(base.tokenizer, "fact", "format_passages"))
    prompts = [tasks.prompt(base.tokenizer, "fact", "format_passages", q) for q in queries]
    where = [place(q.position, 4) for q in queries]
    rows = measure(base, engines, prompts, [q.answer for q in queries], 16, where)
    layers = len(model_support(base.model).layers)
    print(systems.machine(base)["cpu"], f"{args.queries} questions")
    header = f"{'option':22} {'cost':>5} {'acc%':>5} {'share%':>6} {'greedy%':>7} {'KL':>6}"
    print(header, " first/middle/last acc%")
    for name, line in lines(rows).items():
        cost = average(SCHEDULES[name][1], layers) if name in SCHEDULES else 0.0
        by = line["accuracy_by_place_pct"]
        places = "/".join(f"{by.get(p, 0):.0f}" for p in ("first", "middle", "last"))
        print(
            f"{name:22} {cost:5.3f} {line['accuracy_pct']:5.0f} "
            f"{line['accuracy_share_pct'] or 0:6.0f} {line['greedy16_match_pct'] or 0:7.0f} "
            f"{line['mean_kl'] or 0:6.3f}  {places}"
        )


if __name__ == "__main__":
    main()
