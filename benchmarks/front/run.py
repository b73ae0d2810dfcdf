"""The fidelity front: TTFT speed-up against accuracy kept, for each reuse option.

    python -m benchmarks.front [--quick] [--dtype bfloat16|float32]
        [--systems front|prefix] [--queries N] [--out docs/bench]

Every option is an engine over one loaded model; each answers the same prompts as a full
prefill (HF ``generate``), interleaved query by query. Per option and workload: TTFT
median and p90, speed-up over full prefill in the same run, task accuracy and its share
of full prefill's, greedy agreement with full prefill's answer, KL at the answer tokens
(teacher-forced, ``answer_logits``) and passages reused from another prefix's variant
(foreign) or not cached (missed). Workloads (``front_tasks``): fact and essay questions,
~1k and ~2k-token prompts (4 and 8 passages), the pool all or half warmed under the
prompt's prefix, three passage layouts; and a foreign-prefix scenario (pool warmed under
another system prompt) deciding ``prefix_fallback``. Caches are emptied between
workloads. ``--systems prefix`` runs only the BOS-vs-real-prefix options on the 1k
table, ``--systems probe`` the query repair with its question run over 8 of 30 layers.

Writes ``front[-prefix|-probe]-<dtype>.json`` and a Pareto chart ``.png`` beside it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.front import tasks
from benchmarks.front.measure import lines, measure, place, tokens, warm_up
from benchmarks.front.options import FOREIGN, FOREIGN_SYSTEM, OPTIONS, SYSTEM_SETS
from benchmarks.front.report import (
    bos_vs_prefix,
    draw_front,
    print_cell,
    print_prefix,
    print_totals,
    totals,
)
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common import systems
from kvboost_rag.bench.common.baseline import write_report
from kvboost_rag.bench.common.corpus import passages
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.cli.arguments import (
    ArgumentParser,
    add_weights,
    dtype_name,
    positive,
    positive_list,
)

SIZES = {4: "1k", 8: "2k"}  # passages per prompt -> prompt size
PASSAGE_TOKENS = (190, 240)  # essay pieces between these lengths: 4 make ~1k tokens


@dataclass(frozen=True)
class Cell:
    """One workload: a task, a layout, passages per prompt and what was warmed."""

    task: str
    queries: int
    layout: str = "format_passages"
    passages: int = 4
    warm: str = "all"  # "all", "half" (every other passage of the pool) or "foreign"
    form: str = "chat"  # "chat" (the chat template) or "completion" (plain text)
    marks: str = "marked"  # "marked" (passage markers) or "plain" (none: found by content)

    @property
    def name(self) -> str:
        form = "" if self.form == "chat" else f" {self.form}"
        marks = "" if self.marks == "marked" else f" {self.marks}"
        return f"{self.task} {SIZES[self.passages]} {self.layout} {self.warm}{form}{marks}"

    @property
    def pool(self) -> int:
        """Passages the queries draw from: each question its own target where there are
        enough queries, each passage in several prompts. Warming costs time per passage
        and option, so no more than that."""
        return max(8, self.passages + 4, self.queries)


@dataclass(frozen=True)
class Plan:
    """How much of each workload to run."""

    # Sized for ~15 minutes on 2 CPU cores (bf16; from the quick plan's cells): a query
    # costs ~17 s over the ten options at 1k tokens, ~20 s at 2k, a foreign one ~9 s, and
    # warming a pool ~1 s per 1k tokens and option.
    queries: int = 10  # the main table (1k, format_passages, all warmed), per task
    matrix_queries: int = 2  # each other layout / size / warm cell
    foreign_queries: int = 3  # the foreign-prefix scenario, per task
    new_tokens: int = 16
    matrix: tuple[tuple[str, str, int, str], ...] = tuple(
        (task, layout, k, warm)
        for task in ("fact", "essay")
        for layout, k, warm in [
            ("format_passages", 4, "half"),
            ("format_passages", 8, "all"),
            ("numbered", 4, "all"),
            ("headers", 4, "all"),
        ]
    )
    foreign_tasks: tuple[str, ...] = ("fact", "essay")
    tasks: tuple[str, ...] = tasks.TASKS  # the main table's tasks
    forms: tuple[str, ...] = ("chat",)  # and their forms
    marks: tuple[str, ...] = ("marked",)  # and whether their passages are marked

    def cells(self, options: str, sizes: tuple[int, ...] = (4,)) -> list[Cell]:
        main = [
            Cell(task, self.queries, passages=k, form=form, marks=marks)
            for k in sizes
            for form in self.forms
            for task in self.tasks
            for marks in self.marks
        ]
        if options != "front":
            return main
        return [
            *main,
            *(Cell(t, self.matrix_queries, layout, k, w) for t, layout, k, w in self.matrix),
            *(Cell(t, self.foreign_queries, warm="foreign") for t in self.foreign_tasks),
        ]


QUICK = Plan(
    queries=1,
    matrix_queries=1,
    foreign_queries=1,
    matrix=(("fact", "numbered", 4, "half"), ("essay", "headers", 8, "all")),
    foreign_tasks=("fact",),
)


@dataclass(frozen=True)
class Workloads:
    """What every cell draws from."""

    texts: list[str]  # essay pieces; each cell samples its pool from them
    retriever: tasks.Retriever
    new_tokens: int
    seed: int
    cycle: bool = False  # the answer's passage at every position in turn


def run_cell(
    base: KVBoost, engines: dict[str, KVBoost], cell: Cell, work: Workloads, index: int
) -> dict[str, Any]:
    """Warm the cell's pool as it says, run its queries, then empty every cache."""
    start = time.perf_counter()
    rng = random.Random(work.seed + index)
    texts = rng.sample(work.texts, cell.pool)
    seed = rng.randrange(1 << 30)
    queries, pool, found = tasks.batch(
        cell.task, texts, cell.passages, cell.queries, seed, work.retriever, work.cycle
    )
    system = FOREIGN_SYSTEM if cell.warm == "foreign" else None
    prefix = tasks.warm_prefix(base.tokenizer, cell.task, cell.layout, system, cell.form)
    warming = systems.warm(engines, pool[::2] if cell.warm == "half" else pool, prefix)
    prompts = [
        tasks.prompt(base.tokenizer, cell.task, cell.layout, q, form=cell.form) for q in queries
    ]
    if cell.marks == "plain":  # what a default chain or an HTTP client sends
        prompts = [tasks.unmarked(p) for p in prompts]
    where = [place(q.position, cell.passages) for q in queries]
    rows = measure(base, engines, prompts, [q.answer for q in queries], work.new_tokens, where)
    for engine in engines.values():
        engine.clear_cache()
    return asdict(cell) | {
        "name": cell.name,
        "pool_passages": len(pool),
        "median_prompt_tokens": median([len(tokens(base, p)) for p in prompts]),
        "retrieval_found_pct": None if found is None else 100 * found,
        "warming": warming,
        "seconds": time.perf_counter() - start,
        "systems": lines(rows),
    }


def engines_for(base: KVBoost, options: dict[str, dict[str, Any]]) -> dict[str, KVBoost]:
    return {
        name: KVBoost(base.model, base.tokenizer, KVBoostConfig(**cfg))
        for name, cfg in options.items()
    }


def run(
    base: KVBoost,
    plan: Plan,
    options: str,
    seed: int,
    cycle: bool = False,
    sizes: tuple[int, ...] = (4,),
) -> dict[str, Any]:
    """Every cell of the plan; the foreign scenario on its own engines."""
    main = engines_for(base, {n: OPTIONS[n] for n in SYSTEM_SETS[options]})
    foreign = engines_for(base, FOREIGN) if options == "front" else {}
    todo = plan.cells(options, sizes)
    low, high = PASSAGE_TOKENS
    texts = passages(base.tokenizer, high, max(48, *(c.pool for c in todo)), min_tokens=low)
    work = Workloads(texts, tasks.Retriever(), plan.new_tokens, seed, cycle)
    warm_up(base, main | foreign)
    cells: dict[str, Any] = {}
    for i, cell in enumerate(todo):
        engines = foreign if cell.warm == "foreign" else main
        twin = replace(cell, marks="marked")  # a plain cell asks its marked twin's queries
        seed = todo.index(twin) if twin in todo else i
        cells[cell.name] = run_cell(base, engines, cell, work, seed)
        print_cell(cells[cell.name])
    report: dict[str, Any] = {"plan": asdict(plan), "systems": options, "cells": cells}
    report["options"] = {n: OPTIONS[n] for n in main} | {n: FOREIGN[n] for n in foreign}
    report["bos_vs_prefix"] = bos_vs_prefix(report["cells"], SYSTEM_SETS["prefix"])
    print_prefix(report["bos_vs_prefix"])
    report["totals"] = totals({n: c for n, c in cells.items() if c["warm"] != "foreign"})
    print_totals(report["totals"])
    return report


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.front",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default=None, type=dtype_name, help="float32 or bfloat16 (default: auto)"
    )
    add_weights(parser)
    parser.add_argument("--systems", choices=sorted(SYSTEM_SETS), default="front")
    parser.add_argument("--quick", action="store_true", help="one query per cell, fewer cells")
    parser.add_argument("--queries", type=positive, help="main-table queries per task")
    parser.add_argument("--matrix-queries", type=positive, help="queries per other cell")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tasks",
        type=lambda v: _choices(v, tasks.TASKS),
        help=f"the main table's tasks, comma-separated (default: all of {','.join(tasks.TASKS)})",
    )
    parser.add_argument(
        "--forms",
        type=lambda v: _choices(v, tasks.FORMS),
        help="their prompt forms: chat, completion or both (default: chat)",
    )
    parser.add_argument(
        "--marks",
        type=lambda v: _choices(v, ("marked", "plain")),
        help="their passages marked, plain (found by content) or both (default: marked)",
    )
    parser.add_argument("--new-tokens", type=positive, help="tokens of each answer (16)")
    parser.add_argument(
        "--positions",
        action="store_true",
        help="put the answer's passage at every position in turn",
    )
    parser.add_argument(
        "--sizes",
        type=positive_list,
        default=[4],
        help="passages per prompt of the main cells: 4 (~1k tokens), 8 (~2k)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    plan = QUICK if args.quick else Plan()
    plan = replace(plan, queries=args.queries or plan.queries)
    plan = replace(plan, matrix_queries=args.matrix_queries or plan.matrix_queries)
    plan = replace(
        plan,
        tasks=args.tasks or plan.tasks,
        forms=args.forms or plan.forms,
        marks=args.marks or plan.marks,
        new_tokens=args.new_tokens or plan.new_tokens,
    )
    base = KVBoost.from_pretrained(
        args.model, dtype=args.dtype, weights=args.weights, config=KVBoostConfig(fidelity="exact")
    )
    report: dict[str, Any] = {
        "command": " ".join(
            ["python -m benchmarks.front", *(sys.argv[1:] if argv is None else argv)]
        ),
        "model": args.model,
        "weights": args.weights or "checkpoint",
        "machine": systems.machine(base),
    }
    dtype = str(base.model.dtype).removeprefix("torch.")  # what was loaded names the files
    sizes = tuple(args.sizes)
    report |= run(base, plan, args.systems, args.seed, args.positions, sizes)
    report["wall_s"] = time.perf_counter() - start
    # a registered model other than the default names its files; a folder path does not
    model = [] if args.model == "smollm2-135m-instruct" or "/" in args.model else [args.model]
    weights = [args.weights] if args.weights else []
    systems_name = [] if args.systems == "front" else [args.systems]
    stem = "-".join(["front", *systems_name, *model, dtype, *weights])
    report["chart"] = str(draw_front(report, args.out / f"{stem}.png"))
    write_report(args.out, f"{stem}.json", report)
    print(f"total wall time {report['wall_s']:.0f} s")


def _choices(value: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    picked = tuple(v for v in value.split(",") if v)
    wrong = [v for v in picked if v not in allowed]
    if wrong or not picked:
        raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}, got {value!r}")
    return picked


if __name__ == "__main__":
    main()
