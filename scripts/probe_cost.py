"""What the question probe of the "query" repair costs alone, three ways, side by side.

    .venv/bin/python scripts/probe_cost.py [--requests 8] [--out probe-cost.json]

On warmed ~750-token fact prompts (4 passages of a 12-passage pool, the answer's passage at
each position in turn), SmolLM2-135M at the engine's dtype, ``balanced`` engines that
differ only in the probe: a model-wide switch to eager attention over all layers (how the
probe ran before issue 26, and how it still runs on models without SDPA), scores taken
beside SDPA over all layers, and beside SDPA over the first 8 layers (``balanced``'s
default). Per way: the median of ``Timings.repair_ms`` (choosing the tokens: the probe and
the top-k) and of TTFT, each request answered by the three in turn. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any
from unittest import mock

import kvboost_rag.core.reuse.repair as repair
from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common.corpus import fact_passages, messages_for, passages, warm_prefix
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.bench.common.systems import machine

WAYS = {  # name -> (probe layers, eager)
    "eager, 30 layers (before)": (30, True),
    "SDPA + scores, 30 layers": (30, False),
    "SDPA + scores, 8 layers (balanced)": (8, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("probe-cost.json"))
    args = parser.parse_args()
    base = KVBoost.from_pretrained("smollm2-135m-instruct")
    pool = fact_passages(passages(base.tokenizer, 180, 12), 0)
    engines = {
        name: KVBoost(base.model, base.tokenizer, KVBoostConfig(probe_layers=layers))
        for name, (layers, _) in WAYS.items()
    }
    for engine in engines.values():
        warm_corpus(engine, [p.text for p in pool], prefix=warm_prefix(), progress=False)
    rng = random.Random(1)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in WAYS}
    for i in range(args.requests):
        docs = rng.sample(pool, 4)
        messages = messages_for(docs, docs[i % 4].question)
        for name, (_, eager) in WAYS.items():
            with mock.patch.object(repair, "runs_sdpa", lambda model, sdpa=not eager: sdpa):
                result = engines[name].chat(messages, max_new_tokens=1)
            runs[name].append((result.timings.repair_ms, result.ttft_ms))
    report: dict[str, Any] = {"machine": machine(base), "load": os.getloadavg(), "ways": {}}
    print(f"{'probe':<38}{'probe ms':>9}{'TTFT ms':>9}{'share':>7}")
    for name, pairs in runs.items():
        probe, ttft = median([p for p, _ in pairs]), median([t for _, t in pairs])
        report["ways"][name] = {"probe_ms": probe, "ttft_ms": ttft, "runs": pairs}
        print(f"{name:<38}{probe:9.1f}{ttft:9.1f}{100 * probe / ttft:6.1f}%")
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
