"""The ``kvboost-rag`` command: ``demo`` (the README's main job) and ``bench``."""

from __future__ import annotations

import argparse
import sys

from kvboost_rag.bench import chat as chat_bench


def demo(args: argparse.Namespace) -> None:
    """A short conversation on the embedded model: each answer with its TTFT, the share of
    the prompt served from cache, and a full-prefill TTFT of the same tokens beside it."""
    from kvboost_rag import KVBoost
    from kvboost_rag.bench.baseline import full_prefill

    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    print(
        f"model {args.model} ({engine.model.dtype}), "
        f"cache block {engine.config.block_tokens} tokens\n"
    )
    messages = [{"role": "system", "content": chat_bench.SYSTEM}]
    for question in chat_bench.QUESTIONS[: args.turns]:
        messages.append({"role": "user", "content": question})
        result = engine.chat(messages, max_new_tokens=args.max_new_tokens)
        base = full_prefill(
            engine.model, lambda: engine.tokenize_chat(messages), args.max_new_tokens
        )
        print(f"user: {question}\nassistant: {result.text.strip()}")
        print(
            f"  TTFT {result.ttft_ms:6.1f} ms | full prefill {base.ttft_ms:6.1f} ms | "
            f"reused {result.reused_tokens}/{result.prompt_tokens} prompt tokens "
            f"({100 * result.kv_reuse_ratio:.0f}%)\n"
        )
        messages.append({"role": "assistant", "content": result.text})
    print(engine.stats().cache)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvboost-rag", description="kvboost-rag tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="a short chat on the embedded model, with timings")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: auto)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(func=demo)
    b = sub.add_parser("bench", help="benchmarks; args after `bench chat` go to the workload")
    b.add_argument("workload", choices=["chat"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=lambda a: chat_bench.main(a.rest))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
