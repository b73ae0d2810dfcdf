"""Which attention form a decoding step's rows should take, at a model's shape and dtype.

    .venv/bin/python scripts/attention_forms.py --heads 12 --kv-heads 2 --dim 128 \\
        --dtype bfloat16 [--keys 900] [--repeats 30] [--out attention-forms.json]

Times, interleaved, over ``keys`` keys for 1 and 8 rows of 1, 2, 4 and 8 queries under a
step's boolean mask (every other row padded by 100 keys): ``few_query_attention`` (the
engine's float32 matrix products, ``core/model/attention.py``), transformers'
``sdpa_attention_forward`` (``repeat_kv`` copies) and SDPA's grouped heads
(``enable_gqa=True``, no copy). ``FEW_QUERY_DTYPES`` there rests on this. Prints a table
and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvboost_rag.core.model.attention import few_query_attention


def the_forms(
    module: object, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
) -> dict[str, Callable[[], object]]:
    return {
        "few_query": lambda: few_query_attention(module, query, key, value, mask, None),
        "transformers_sdpa": lambda: sdpa_attention_forward(
            module, query, key, value, mask, scaling=None
        ),
        "grouped_sdpa": lambda: F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, enable_gqa=True
        ),
    }


def measure(args: argparse.Namespace) -> list[dict[str, float]]:
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    module = SimpleNamespace(
        num_key_value_groups=args.heads // args.kv_heads, is_causal=True, training=False
    )
    rows = []
    for batch in (1, 8):
        for q in (1, 2, 4, 8):
            query = torch.randn(batch, args.heads, q, args.dim, dtype=dtype)
            key, value = (
                torch.randn(batch, args.kv_heads, args.keys, args.dim, dtype=dtype)
                for _ in range(2)
            )
            mask = torch.ones(batch, 1, q, args.keys, dtype=torch.bool).tril(args.keys - q)
            mask[::2, :, :, args.keys - q - 100 : args.keys - q] = False  # padded rows
            forms = the_forms(module, query, key, value, mask)
            times: dict[str, list[float]] = {name: [] for name in forms}
            with torch.inference_mode():
                for form in forms.values():
                    form()
                for _ in range(args.repeats):
                    for name, form in forms.items():
                        start = time.perf_counter()
                        form()
                        times[name].append(time.perf_counter() - start)
            row = {"rows": batch, "queries": q}
            row.update({f"{n}_ms": statistics.median(t) * 1e3 for n, t in times.items()})
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--kv-heads", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--keys", type=int, default=900)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = measure(args)
    print(f"{args.heads}/{args.kv_heads} heads of {args.dim}, {args.dtype}, {args.keys} keys,")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; ms a layer (median)")
    print("rows queries  few_query  transformers_sdpa  grouped_sdpa")
    for r in rows:
        print(
            f"{r['rows']:4} {r['queries']:7} {r['few_query_ms']:10.3f} "
            f"{r['transformers_sdpa_ms']:18.3f} {r['grouped_sdpa_ms']:13.3f}"
        )
    if args.out:
        record = {"command": "scripts/attention_forms.py", "args": vars(args), "rows": rows}
        args.out.write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
