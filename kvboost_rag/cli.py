"""The ``kvboost-rag`` command: ``demo`` (the README's main job), ``bench`` and ``warm``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvboost_rag.bench import chat as chat_bench
from kvboost_rag.bench import rag as rag_bench
from kvboost_rag.bench import suite
from kvboost_rag.bench import warm as warm_bench

BENCHES: dict[str, Callable[[list[str]], None]] = {
    "all": suite.main,
    "chat": chat_bench.main,
    "rag": rag_bench.main,
    "warm": warm_bench.main,
}


def _line(result: Any, base: Any) -> str:
    return (
        f"  TTFT {result.ttft_ms:6.1f} ms | full prefill {base.ttft_ms:6.1f} ms | "
        f"reused {result.reused_tokens}/{result.prompt_tokens} prompt tokens "
        f"({100 * result.kv_reuse_ratio:.0f}%), passages hit {result.passages_hit}"
    )


def demo(args: argparse.Namespace) -> None:
    """A conversation, then questions over essay passages retrieved in changing orders:
    each answer with its TTFT, the share of the prompt served from cache, and a
    full-prefill TTFT of the same tokens beside it."""
    from kvboost_rag import KVBoost
    from kvboost_rag.bench.baseline import full_prefill
    from kvboost_rag.bench.corpus import fact_passages, passages

    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    print(f"model {args.model} ({engine.model.dtype}), fidelity {engine.config.fidelity}\n")
    print("== multi-turn chat (history reused exactly) ==")
    messages = [{"role": "system", "content": chat_bench.SYSTEM}]
    for question in chat_bench.QUESTIONS[: args.turns]:
        messages.append({"role": "user", "content": question})
        result = engine.chat(messages, max_new_tokens=args.max_new_tokens)
        base = full_prefill(engine.model, partial(engine.tokenize_chat, messages), 1)
        print(f"user: {question}\nassistant: {result.text.strip()}\n{_line(result, base)}\n")
        messages.append({"role": "assistant", "content": result.text})

    print("== RAG over Paul Graham essay passages (each passage's KV reused) ==")
    pool = fact_passages(passages(engine.tokenizer, 140, 24), seed=0)
    start = time.perf_counter()
    warmed = engine.warm_passages([p.text for p in pool])
    print(
        f"warmed {warmed.passages} passages ({warmed.tokens} tokens) in "
        f"{time.perf_counter() - start:.1f} s\n"
    )
    for docs, target in rag_bench.queries(pool, 7, args.questions, seed=1):
        rag_messages = rag_bench.messages_for(docs, target.question)
        result = engine.chat(rag_messages, max_new_tokens=16)
        base = full_prefill(engine.model, partial(engine.tokenize_chat, rag_messages), 1)
        print(f"Q: {target.question} (expected {target.answer})\nA: {result.text.strip()}")
        print(_line(result, base) + "\n")
    print(engine.stats().cache)


def warm_folder(args: argparse.Namespace) -> None:
    """Warm every matching text file of a folder into ``--cache-dir`` and print the report."""
    from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus

    files = sorted(p for p in args.folder.glob(args.glob) if p.is_file())
    if not files:
        raise SystemExit(f"no files match {args.glob!r} in {args.folder}")
    config = KVBoostConfig(cache_dir=args.cache_dir, fidelity=args.fidelity)
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype, config=config)
    report = warm_corpus(engine, [p.read_text(encoding="utf-8") for p in files])
    disk = engine.stats().disk
    assert disk is not None
    print(
        f"warmed {report.documents} files into {report.passages} passages "
        f"({report.tokens} tokens; {report.new} new, {report.cached} already cached) in "
        f"{report.seconds:.1f} s = {report.tokens_per_s:.0f} tokens/s; "
        f"{disk.bytes / 2**20:.0f} MiB in {disk.entries} files under {args.cache_dir}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvboost-rag", description="kvboost-rag tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="chat and RAG on the embedded model, with timings")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: auto)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(func=demo)
    # Listed for --help only: main() hands bench's arguments to the workload's own parser,
    # so options and their values pass through whatever they look like.
    sub.add_parser(
        "bench",
        help="bench [--quick]: every workload and system in one run; "
        "bench chat|rag|warm ...: one workload",
    )
    w = sub.add_parser("warm", help="warm a folder of text files into a cache_dir")
    w.add_argument("folder", type=Path)
    w.add_argument("--cache-dir", required=True, help="the disk tier every process reads")
    w.add_argument("--glob", default="*.txt", help="which files of the folder (default *.txt)")
    w.add_argument("--model", default="smollm2-135m-instruct")
    w.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: auto)")
    w.add_argument("--fidelity", default="balanced", choices=["balanced", "fast"])
    w.set_defaults(func=warm_folder)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        rest = argv[1:]
        workload = rest.pop(0) if rest and rest[0] in BENCHES else "all"
        BENCHES[workload](rest)
        return
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
