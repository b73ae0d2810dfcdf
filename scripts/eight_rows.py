"""Eight requests at once with each value of one of the engine's constants, end to end.

    .venv/bin/python scripts/eight_rows.py MODEL ROUNDS OUT.json MODULE.NAME=V1 V2 ...

One ``balanced`` engine over a warmed pool answers 8 RAG chat requests at once (8 threads),
64 tokens each (``min_new_tokens``), of ``bench decode``'s two kinds (extractive: quote a
passage; open-ended: in your own words). The constant ``NAME`` of the module
``kvboost_rag.core.MODULE`` takes each value (Python expressions; ``torch`` is in scope)
in turn between rounds, the order alternating. Prints each round's wall time and writes
JSON. E.g. ``generation.drafting.BATCH_DRAFT_TOKENS=1 2`` or
``model.attention.FEW_QUERIES=2 4``.
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import threading
import time
from typing import Any

import torch

from benchmarks.decode.contenders import _passages
from benchmarks.decode.run import prompts
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.corpus import warm_prefix

KINDS = ("extractive", "open-ended")


def answer_all(engine: KVBoost, chats: list[Any]) -> tuple[float, list[Any]]:
    out: list[Any] = [None] * len(chats)

    def run(i: int) -> None:
        out[i] = engine.chat(chats[i], max_new_tokens=64)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chats))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, out


def main() -> None:
    model, rounds, path, setting, *values = sys.argv[1:]
    where, name = setting.split("=", 1)[0].rsplit(".", 1)
    values = [setting.split("=", 1)[1], *values]
    module = importlib.import_module(f"kvboost_rag.core.{where}")
    choices = {value: eval(value, {"torch": torch}) for value in values}  # noqa: S307 - a lab script
    base = KVBoost.from_pretrained(model, dtype="bfloat16")
    engine = KVBoost(base.model, base.tokenizer, KVBoostConfig(fidelity="balanced"))
    chats = {kind: prompts(base, kind, 8, 0) for kind in KINDS}
    engine.warm_passages(_passages([c for k in KINDS for c in chats[k]]), prefix=warm_prefix())
    base.model.generation_config.min_new_tokens = 64
    runs: dict[str, list[dict[str, Any]]] = {f"{v} {k}": [] for v in choices for k in KINDS}
    for r in range(int(rounds)):
        order = list(choices.items()) if r % 2 == 0 else list(choices.items())[::-1]
        for value, chosen in order:
            setattr(module, name, chosen)
            for kind in KINDS:
                wall, out = answer_all(engine, chats[kind])
                tokens = sum(len(o.token_ids) for o in out)
                answers = [o.token_ids for o in out]
                runs[f"{value} {kind}"].append(
                    {"wall_s": wall, "tokens": tokens, "answers": answers}
                )
                print(
                    f"{r} {name}={value} {kind}: {wall:.1f} s, {tokens / wall:.1f} tokens/s",
                    flush=True,
                )
    summary = {
        run: statistics.median(x["tokens"] / x["wall_s"] for x in v) for run, v in runs.items()
    }
    print("median tokens/s:", json.dumps(summary))
    with open(path, "w") as f:
        json.dump(
            {"model": model, "constant": f"{where}.{name}", "runs": runs, "tokens_per_s": summary},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
