"""Multi-turn chat: per turn, prefix reuse and TTFT against full prefill, side by side.

    python -m benchmarks.chat [--dtype float32|bfloat16] [--repeats 3] [--out DIR]

Each repeat replays the whole conversation on an empty cache; after every engine call the
same prompt tokens are decoded by plain ``model.generate`` (full prefill), interleaved so
both see the same machine state. Medians over repeats are reported.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvboost_rag import KVBoost
from kvboost_rag.bench.common.baseline import full_prefill, write_report
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive

SYSTEM = (
    "You are a helpful assistant for a small bakery. The bakery opens at 7 am and closes at "
    "6 pm, Tuesday to Sunday. It sells sourdough, rye, baguettes, croissants, cinnamon rolls "
    "and seasonal fruit tarts. Orders over 20 dollars get free delivery within 5 miles. "
    "Answer briefly and politely, and never invent products the bakery does not sell."
)
QUESTIONS = [
    "What time do you open on Saturday?",
    "Do you sell croissants?",
    "Is delivery free for a 25 dollar order?",
    "Which breads do you have?",
    "Are you open on Mondays?",
    "Recommend a pastry for breakfast.",
]


def run(engine: KVBoost, repeats: int, max_new_tokens: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = [{"ttft": [], "base": [], "match": []} for _ in QUESTIONS]
    for _ in range(repeats):
        engine.clear_cache()
        messages = [{"role": "system", "content": SYSTEM}]
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            result = engine.chat(messages, max_new_tokens=max_new_tokens)
            base = full_prefill(
                engine.model, partial(engine.tokenize_chat, messages), max_new_tokens
            )
            row = turns[turn]
            row.update(prompt=result.prompt_tokens, reused=result.reused_tokens)
            row["ttft"].append(result.ttft_ms)
            row["base"].append(base.ttft_ms)
            row["match"].append(result.token_ids == base.token_ids)
            messages.append({"role": "assistant", "content": result.text})
    return [_summary(i + 1, row) for i, row in enumerate(turns)]


def _summary(turn: int, row: dict[str, Any]) -> dict[str, Any]:
    ttft, base = median(row["ttft"]), median(row["base"])
    return {
        "turn": turn,
        "prompt_tokens": row["prompt"],
        "reused_tokens": row["reused"],
        "reuse_pct": 100 * row["reused"] / row["prompt"],
        "ttft_ms": ttft,
        "full_prefill_ttft_ms": base,
        "speedup": base / ttft,
        "identical_output_pct": 100 * sum(row["match"]) / len(row["match"]),
    }


def decode_throughput(engine: KVBoost, max_new_tokens: int, repeats: int) -> dict[str, float]:
    """Tokens/s after the first token, engine (on a reused cache) vs plain generate."""
    prompt = "Write a long, detailed story about a baker who travels the world. " * 8
    engine.warm(prompt)
    ours, base = [], []
    for _ in range(repeats):
        r = engine.generate(prompt, max_new_tokens=max_new_tokens)
        ours.append((len(r.token_ids) - 1) / (r.timings.decode_ms / 1e3))
        base.append(
            full_prefill(
                engine.model, lambda: engine.tokenize(prompt), max_new_tokens
            ).decode_tokens_per_s
        )
    return {
        "engine_tok_s": median(ours),
        "generate_tok_s": median(base),
        "ratio": median(ours) / median(base),
        "tokens": len(r.token_ids),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'turn':>4} {'prompt':>6} {'reused':>6} {'reuse%':>6} {'TTFT ms':>8} "
        f"{'full ms':>8} {'speedup':>7} {'same out%':>9}"
    )
    for r in rows:
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>6} {r['reused_tokens']:>6} "
            f"{r['reuse_pct']:>6.1f} {r['ttft_ms']:>8.1f} {r['full_prefill_ttft_ms']:>8.1f} "
            f"{r['speedup']:>6.2f}x {r['identical_output_pct']:>8.0f}%"
        )


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m benchmarks.chat", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default=None, type=dtype_name, help="float32 or bfloat16 (default: auto)"
    )
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--max-new-tokens", type=positive, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    dtype = str(engine.model.dtype).replace("torch.", "")
    print(f"model={args.model} dtype={dtype} threads={torch.get_num_threads()}")
    rows = run(engine, args.repeats, args.max_new_tokens)
    print_table(rows)
    decode = decode_throughput(engine, 64, args.repeats)
    print(
        f"decode tokens/s: engine {decode['engine_tok_s']:.1f} vs generate "
        f"{decode['generate_tok_s']:.1f} ({decode['ratio']:.3f}x)"
    )
    report = {
        "model": args.model,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "turns": rows,
        "decode": decode,
    }
    write_report(args.out, f"chat-{dtype}.json", report)


if __name__ == "__main__":
    main()
