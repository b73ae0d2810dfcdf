"""How close a cold prefill comes to this CPU's floor for it.

    .venv/bin/python scripts/prefill_floor.py --model qwen2.5-coder-1.5b-instruct \\
        --dtype bfloat16 --tokens 512,1024,2048 [--repeats 2] [--out docs/bench/prefill-floor]

A prefill of T tokens is compute-bound: every decoder linear layer multiplies T rows by its
weight (2·T·in·out FLOPs), causal attention adds 2·T²·width per layer (scores and weighted
sum over half the square), the head runs on the last row. The floor is those FLOPs at the
best matrix-product rate measured here: each decoder weight shape timed at T rows both
through ``F.linear`` and the way the engine's linear layers take at T rows
(``core/model/linears.py``), the faster per shape, summed over the layers that have it.
Beside it, in the same process, on prompts of T tokens that share no start with any
earlier one (nothing cached holds them), the systems take turns per repeat:
``transformers``, the model's own forward (``logits_to_keep=1``) on the user's model;
``ours cold``, ``KVBoost.generate(max_new_tokens=1)`` at fidelity "exact" (its TTFT:
tokenizing, the forwards, the first token). Prints a table and writes JSON and PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.core.model import linears
from kvboost_rag.core.model.packed import median_seconds


def floor(view: Any, tokens: int, repeats: int) -> dict[str, float]:
    """Seconds the decoder's linear products take at ``tokens`` rows, per shape the faster of
    F.linear and the engine's way, and the rate they reach."""
    layers = linears.engine_layers(view)
    shapes = Counter((la.out_features, la.in_features) for la in layers)
    first = {(la.out_features, la.in_features): la for la in reversed(layers)}
    seconds = flops = 0.0
    for shape, count in shapes.items():
        layer = first[shape]
        x = torch.randn(tokens, layer.in_features).to(layer.weight.dtype)
        with torch.inference_mode():
            plain = median_seconds(lambda la=layer, x=x: F.linear(x, la.weight, la.bias), repeats)
            ours = median_seconds(lambda la=layer, x=x: la(x), repeats)
        seconds += min(plain, ours) * count
        flops += 2.0 * tokens * shape[0] * shape[1] * count
    return {"linear_s": seconds, "linear_flops": flops, "rate": flops / seconds}


def attention_flops(config: Any, tokens: int) -> float:
    width = config.num_attention_heads * getattr(
        config, "head_dim", config.hidden_size // config.num_attention_heads
    )
    return 2.0 * tokens * tokens * width * config.num_hidden_layers  # QK^T and AV, causal half


def prompt_ids(tokenizer: Any, tokens: int, salt: int) -> list[int]:
    """``tokens`` ids of a text no other salt's starts like."""
    text = f"{salt}. " + " ".join(
        f"record {salt}-{i}: the depot shipped {i * 7 % 97} crates." for i in range(4000)
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    engine = KVBoost.from_pretrained(
        args.model,
        dtype=args.dtype,
        config=KVBoostConfig(fidelity="exact", remember_measurements=True),
    )
    model, tokenizer = engine.model, engine.tokenizer
    view = engine._handle.engine_model
    engine.generate("warm up", max_new_tokens=1)
    rows = []
    for n in args.tokens:
        found = floor(view, n, args.repeats)
        total = found["linear_flops"] + attention_flops(model.config, n)
        best = total / found["rate"]
        forward, ours = [], []
        for r in range(args.repeats):  # every prompt new: nothing cached holds its start
            ids = prompt_ids(tokenizer, n, 2 * (n * args.repeats + r))
            with torch.inference_mode():
                start = time.perf_counter()
                model(input_ids=torch.tensor([ids]), logits_to_keep=1)
                forward.append(time.perf_counter() - start)
            ids = prompt_ids(tokenizer, n, 2 * (n * args.repeats + r) + 1)
            result = engine.generate(tokenizer.decode(ids), max_new_tokens=1)
            assert result.reused_tokens == 0, result  # cold: nothing cached
            ours.append(result.ttft_ms / 1e3)
        row = {
            "tokens": n,
            "gflop": total / 1e9,
            "rate_gflops": found["rate"] / 1e9,
            "floor_s": best,
            "transformers_s": statistics.median(forward),
            "ours_cold_s": statistics.median(ours),
        }
        row["ours_of_floor"] = row["floor_s"] / row["ours_cold_s"]
        row["transformers_of_floor"] = row["floor_s"] / row["transformers_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {
        "command": "scripts/prefill_floor.py " + " ".join(args.argv),
        "model": args.model,
        "dtype": str(model.dtype).replace("torch.", ""),
        "cpu": machine(engine)["cpu"],
        "threads": torch.get_num_threads(),
        "speed_profile": {k: str(v) for k, v in vars(engine._handle.profile()).items()},
        "rows": rows,
    }


def table(record: dict[str, Any]) -> str:
    lines = [
        f"{record['model']} ({record['dtype']}), {record['threads']} threads, {record['cpu']}:"
        " cold prefill against the floor",
        "| tokens | GFLOP | best rate GFLOP/s | floor s | transformers s | ours cold TTFT s"
        " | ours at % of floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        lines.append(
            f"| {r['tokens']} | {r['gflop']:.0f} | {r['rate_gflops']:.0f} | {r['floor_s']:.2f} | "
            f"{r['transformers_s']:.2f} | {r['ours_cold_s']:.2f} | "
            f"{100 * r['ours_of_floor']:.0f}% |"
        )
    return "\n".join(lines)


def chart(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    xs = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("floor_s", "floor"),
        ("ours_cold_s", "ours cold TTFT"),
        ("transformers_s", "transformers forward"),
    ):
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("seconds")
    ax.set_title(f"cold prefill, {record['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048]
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/prefill-floor"))
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    record = measure(args)
    text = table(record)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stem = str(args.out)  # a model's name has dots: no with_suffix
    Path(stem + ".json").write_text(json.dumps(record, indent=2))
    Path(stem + ".txt").write_text(text + "\n")
    chart(record, Path(stem + ".png"))


if __name__ == "__main__":
    main()
