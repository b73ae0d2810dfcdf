"""Every workload and every system in one run: ``python -m benchmarks.suite [--quick]``.

One model, dtype and thread count; systems side by side: full prefill (HF ``generate``,
what ``HuggingFacePipeline`` / ``HuggingFaceLLM`` run), the exact prefix cache, each
fidelity level and, when installed, the ``kvboost`` PyPI package. Workloads:

- rag-1k / rag-2k: fact questions over a warmed pool of essay passages, retrieved in
  random order next to random neighbours (~1k and ~2k-token prompts);
- popular: a larger pool nobody warmed, where a few passages are popular (Zipf), so
  caches fill from traffic alone;
- chat: a 6-turn conversation, each turn holding the whole history;
- cold: prompts of passages no system has seen.

Writes ``bench.json`` and ``bench.png`` under ``--out``; ``python -m
benchmarks.suite.report OUT/bench.json`` prints the JSON as tables, and
``scripts/docs_pages.py`` puts ``docs/bench/bench.json``'s on docs/bench/index.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.chat import run as chat_bench
from benchmarks.common.cold import cold_start
from benchmarks.rag import run as rag
from benchmarks.suite.report import print_bench
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common import systems
from kvboost_rag.bench.common.baseline import full_prefill, write_report
from kvboost_rag.bench.common.chart import draw
from kvboost_rag.bench.common.corpus import fact_passages, passages, warm_prefix
from kvboost_rag.bench.common.memory import PeakMemory
from kvboost_rag.bench.common.metrics import median, p90
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name
from kvboost_rag.core.model.loading import default_device


@dataclass(frozen=True)
class Plan:
    """How much of each workload to run."""

    rag_queries: int = 12  # per prompt size
    pool: int = 40  # warmed passages the RAG queries draw from
    popular_pool: int = 60  # unwarmed passages with Zipf popularity
    popular_queries: int = 16
    chat_repeats: int = 3
    chat_new_tokens: int = 32
    cold_prompts: int = 4


QUICK = Plan(
    rag_queries=2,
    pool=14,  # the least a 14-passage prompt can draw from
    popular_pool=24,
    popular_queries=3,
    chat_repeats=1,
    chat_new_tokens=8,
    cold_prompts=1,
)
PASSAGES_PER_PROMPT = {"rag-1k": 7, "rag-2k": 14, "popular": 7, "cold": 8}


def chat_summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [t["ttft_ms"] for t in turns]
    base = median([t["full_prefill_ttft_ms"] for t in turns])
    return {
        "median_ttft_ms": median(ttft),
        "p90_ttft_ms": p90(ttft),
        "full_prefill_ttft_ms": base,
        "speedup": base / median(ttft),
        "reuse_pct": median([t["reuse_pct"] for t in turns]),
        "identical_output_pct": median([t["identical_output_pct"] for t in turns]),
        "turns": turns,
    }


def warm_up(base: KVBoost, engines: dict[str, Any]) -> None:
    """One untimed request per system on text no workload uses, so one-time costs
    (first forward pass, allocator growth) land on no system's numbers."""
    messages = [{"role": "user", "content": "Count slowly from one to ninety. " * 60}]
    full_prefill(base.model, partial(base.tokenize_chat, messages), 2)
    for system in engines.values():
        system.chat(messages, max_new_tokens=2)


def run(base: KVBoost, plan: Plan, with_peer: bool, seed: int) -> dict[str, Any]:
    engines, notes = systems.build(base, with_peer)
    texts = passages(base.tokenizer, 140, plan.pool + plan.popular_pool + 8 * plan.cold_prompts)
    pool = fact_passages(texts[: plan.pool], seed)
    popular = fact_passages(texts[plan.pool : plan.pool + plan.popular_pool], seed + 1)
    fresh = fact_passages(texts[plan.pool + plan.popular_pool :], seed + 2)
    report: dict[str, Any] = {"plan": asdict(plan), "not_run": notes, "workloads": {}}
    warm_up(base, engines)
    report["warm"] = systems.warm(engines, [p.text for p in pool], warm_prefix())
    work = report["workloads"]
    for name in ("rag-1k", "rag-2k"):
        k = PASSAGES_PER_PROMPT[name]
        work[name] = rag.run_size(base, engines, pool, k, plan.rag_queries, seed + k)
        rag.print_table(name, work[name])
    batch = rag.popular_queries(popular, PASSAGES_PER_PROMPT["popular"], plan.popular_queries, seed)
    work["popular"] = rag.run_queries(base, engines, batch)
    rag.print_table("popular", work["popular"])
    report["cache_mib"] = {name: systems.cache_mib(s) for name, s in engines.items()}
    work["cold"] = cold_start(base, engines, fresh, PASSAGES_PER_PROMPT["cold"], plan.cold_prompts)
    rag.print_table("cold", work["cold"])
    work["chat"] = {"repeats": plan.chat_repeats, "systems": {}}
    for name, system in engines.items():
        turns = chat_bench.run(system, plan.chat_repeats, plan.chat_new_tokens)
        work["chat"]["systems"][name] = chat_summary(turns)
        print(f"chat {name}: {work['chat']['systems'][name]['median_ttft_ms']:.0f} ms median")
    peer = engines.get(systems.peer_name())
    if peer is not None:
        report["peer"] = peer.settings() | {
            "self_reported_median_ttft_ms": median(peer.self_reported_ttft_ms)
        }
    return report


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default=None, type=dtype_name, help="float32 or bfloat16 (default: auto)"
    )
    parser.add_argument("--quick", action="store_true", help="a small run (minutes)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peer", action="store_true", help="skip the kvboost package")
    args = parser.parse_args(argv)
    logging.getLogger("kvboost").setLevel(logging.ERROR)  # the peer logs every warm()
    start = time.perf_counter()
    with PeakMemory(default_device()) as load:
        base = KVBoost.from_pretrained(
            args.model, dtype=args.dtype, config=KVBoostConfig(fidelity="exact")
        )
    report = {
        "command": " ".join(
            ["python -m benchmarks.suite", *(sys.argv[1:] if argv is None else argv)]
        ),
        "model": args.model,
        "machine": systems.machine(base) | {"model_load_mib": load.mib},
    }
    report |= run(base, QUICK if args.quick else Plan(), not args.no_peer, args.seed)
    report["wall_s"] = time.perf_counter() - start
    report["machine"]["process_peak_mib"] = max(
        (s["peak_process_mib"] or 0 for w in report["workloads"].values() for s in _rows(w)),
        default=None,
    )
    report["chart"] = str(draw(report, args.out / "bench.png"))
    write_report(args.out, "bench.json", report)
    print_bench(report)


def _rows(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in workload["systems"].values() if "peak_process_mib" in s]


if __name__ == "__main__":
    main()
