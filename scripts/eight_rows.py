"""Eight requests at once with each rule of ``attention.FEW_QUERY_DTYPES``, end to end.

    .venv/bin/python scripts/eight_rows_attention.py MODEL ROUNDS OUT.json

One ``balanced`` engine over a warmed pool of 16 passages answers 8 RAG chat requests at
once (8 threads), 64 tokens each (``min_new_tokens``); the rule switches between rounds,
order alternating. Prints each round's wall time and writes JSON.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
from typing import Any

import torch

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common.corpus import fact_passages, messages_for, passages, warm_prefix
from kvboost_rag.bench.latency.run import K, requests
from kvboost_rag.core.model import attention

RULES = {
    "few-query in bf16 (before)": (torch.float32, torch.bfloat16),
    "grouped SDPA in bf16 (after)": (torch.float32,),
}


def answer_all(engine: KVBoost, prompts: list[Any]) -> tuple[float, list[Any]]:
    out: list[Any] = [None] * len(prompts)

    def run(i: int) -> None:
        out[i] = engine.chat(prompts[i], max_new_tokens=64)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, out


def main() -> None:
    model, rounds, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    base = KVBoost.from_pretrained(model, dtype="bfloat16")
    pool = fact_passages(passages(base.tokenizer, 200, 16), 0)
    engine = KVBoost(base.model, base.tokenizer, KVBoostConfig(fidelity="balanced"))
    warm_corpus(engine, [p.text for p in pool], prefix=warm_prefix(), progress=False)
    base.model.generation_config.min_new_tokens = 64
    docs = requests(pool, 8, random.Random(3))
    prompts = [messages_for(d, d[i % K].question) for i, d in enumerate(docs)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in RULES}
    for r in range(rounds):
        order = list(RULES.items()) if r % 2 == 0 else list(RULES.items())[::-1]
        for name, dtypes in order:
            attention.FEW_QUERY_DTYPES = dtypes
            wall, out = answer_all(engine, prompts)
            tokens = sum(len(o.token_ids) for o in out)
            runs[name].append(
                {"wall_s": wall, "tokens": tokens, "answers": [o.token_ids for o in out]}
            )
            print(f"{r} {name}: wall {wall:.1f} s, {tokens} tokens", flush=True)
    summary = {n: statistics.median(x["wall_s"] for x in v) for n, v in runs.items()}
    print("median wall s:", json.dumps(summary))
    with open(path, "w") as f:
        json.dump({"model": model, "runs": runs, "median_wall_s": summary}, f, indent=1)


if __name__ == "__main__":
    main()
