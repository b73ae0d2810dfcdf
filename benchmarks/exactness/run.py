"""What ``exact`` guarantees per dtype: how often a cached prompt's greedy answer differs.

    python -m benchmarks.exactness [--requests 100] [--new-tokens 24]
        [--dtypes bfloat16,float32] [--out DIR]

Each request is a chat turn (a fixed system prompt, a question of its own) asked three
ways on one model: ``model.generate`` on its tokens (full prefill), then ``KVBoost.chat``
at fidelity ``exact`` twice: cold (nothing of it cached but the system prompt's blocks
from earlier requests) and again (every prompt token but the last read from the cache).
Counted per dtype: answers of the cached request that differ from the cold one, and from
generate's; for scale, generate's own answers for the same prompts in one padded batch of
8 that differ from its answers one at a time (a different, equally valid computation
order). Writes ``exactness.json`` / ``.txt``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.baseline import full_prefill, write_report
from kvboost_rag.bench.common.corpus import passages
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.bench.common.transcript import Transcript, note
from kvboost_rag.cli.arguments import ArgumentParser, dtype_list, positive

SYSTEM = "You are a careful assistant. Answer in one or two sentences, plainly."


def questions(tokenizer: Any, count: int) -> list[str]:
    """Distinct questions about sentences of the essays."""
    out: list[str] = []
    for piece in passages(tokenizer, 60, 4 * count, min_tokens=20):
        sentence = piece.split(". ")[0].strip()
        if sentence and sentence not in out:
            out.append(sentence)
        if len(out) == count:
            break
    return [f'What does this mean: "{s}"?' for s in out]


def batched(model: Any, tokenizer: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``generate`` over padded batches of 8: its own answers in another computation order."""
    padded = copy.deepcopy(tokenizer)
    pad = padded.pad_token_id if padded.pad_token_id is not None else padded.eos_token_id
    out = []
    for i in range(0, len(prompts), 8):
        group = prompts[i : i + 8]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            got = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=pad,
            )
        out += [row[width:].tolist() for row in got]
    return out


def measure(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    base = KVBoost.from_pretrained(args.model, dtype=dtype, config=KVBoostConfig(fidelity="exact"))
    model, tokenizer = base.model, base.tokenizer
    engine = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact", draft_tokens=0))
    asked = questions(tokenizer, args.requests)
    rows: list[dict[str, Any]] = []  # one JSON row per request
    prompts: list[list[int]] = []
    start = time.perf_counter()
    for i, question in enumerate(asked):
        note(f"{dtype} request {i + 1}/{len(asked)}")
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        tokens = engine.tokenize_chat(messages)
        prompts.append(tokens)
        full = full_prefill(model, functools.partial(list, tokens), args.new_tokens).token_ids
        cold = engine.chat(messages, max_new_tokens=args.new_tokens)
        again = engine.chat(messages, max_new_tokens=args.new_tokens)
        rows.append(
            {
                "prompt_tokens": len(tokens),
                "cold_reused": cold.reused_tokens,
                "again_reused": again.reused_tokens,
                "generate": full,
                "cold": cold.token_ids,
                "again": again.token_ids,
            }
        )
    padded = batched(model, tokenizer, prompts, args.new_tokens)
    for row, ids in zip(rows, padded):
        row["generate_batched"] = ids
    n = len(rows)
    return {
        "dtype": dtype,
        "machine": machine(base),
        "requests": n,
        "again_differs_from_cold": sum(r["again"] != r["cold"] for r in rows),
        "again_differs_from_generate": sum(r["again"] != r["generate"] for r in rows),
        "cold_differs_from_generate": sum(r["cold"] != r["generate"] for r in rows),
        "generate_batched_differs": sum(r["generate_batched"] != r["generate"] for r in rows),
        "mean_again_reused_share": sum(r["again_reused"] / r["prompt_tokens"] for r in rows) / n,
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }


def table(results: list[dict[str, Any]], command: str) -> str:
    m = results[0]["machine"]
    lines = [
        f"{m['cpu']} ({m['cpu_count']} cores, {m['threads']} threads), torch {m['torch']}, "
        f"transformers {m['transformers']}",
        f"command: {command}",
        "",
        f"{'dtype':<10}{'requests':>9}{'again!=cold':>13}{'again!=gen':>12}{'cold!=gen':>11}"
        f"{'gen batch8!=gen':>17}{'reused again':>14}",
    ]
    for r in results:
        lines.append(
            f"{r['dtype']:<10}{r['requests']:>9}{r['again_differs_from_cold']:>13}"
            f"{r['again_differs_from_generate']:>12}{r['cold_differs_from_generate']:>11}"
            f"{r['generate_batched_differs']:>17}{100 * r['mean_again_reused_share']:>13.0f}%"
        )
    lines += [
        "",
        "Counts of requests (of 'requests') whose greedy answer differs. again: the same "
        "request served from the exact prefix cache (every prompt token but the last "
        "reused); cold: its first run; gen: model.generate one at a time; gen batch8: "
        "model.generate over padded batches of 8.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.exactness", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=positive, default=100)
    parser.add_argument("--new-tokens", type=positive, default=24)
    parser.add_argument("--dtypes", type=dtype_list, default=["bfloat16", "float32"])
    parser.add_argument("--threads", type=positive, default=None)
    parser.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    command = "python -m benchmarks.exactness " + " ".join(sys.argv[1:] if argv is None else argv)
    results = [measure(d, args) for d in args.dtypes]
    transcript = Transcript()
    for line in table(results, command).splitlines():
        transcript.say(line)
    write_report(args.out, "exactness.json", {"command": command, "results": results})
    (args.out / "exactness.txt").write_text(transcript.text())


if __name__ == "__main__":
    main()
