"""Cold start: prompts whose passages no system has seen, so nothing can be reused and
every system pays its full price for storing what it computes."""

from __future__ import annotations

from functools import partial
from typing import Any

from kvboost_rag import KVBoost
from kvboost_rag.bench.common.baseline import full_prefill
from kvboost_rag.bench.common.corpus import FactPassage, messages_for
from kvboost_rag.bench.common.memory import PeakMemory
from kvboost_rag.bench.common.metrics import Row, median, summary


def cold_start(
    base: KVBoost, systems: dict[str, Any], fresh: list[FactPassage], k: int, n: int
) -> dict[str, Any]:
    """``n`` prompts of ``k`` unseen passages each: a full prefill, then every system on
    the same prompt (each has its own cache, so each sees the passages for the first time).
    """
    assert len(fresh) >= k * n, f"cold start needs {k * n} fresh passages, got {len(fresh)}"
    rows = {name: Row() for name in ["full prefill", *systems]}
    lengths = []
    for i in range(n):
        docs = fresh[i * k : (i + 1) * k]
        messages = messages_for(docs, docs[0].question)
        lengths.append(len(base.tokenize_chat(messages)))
        with PeakMemory(base.model.device) as peak:
            ref = full_prefill(base.model, partial(base.tokenize_chat, messages), 1)
        rows["full prefill"].add_run(ref.ttft_ms, ref.token_ids, 0.0)
        rows["full prefill"].add_peak(peak)
        for name, system in systems.items():
            with PeakMemory(base.model.device) as peak:
                result = system.chat(messages, max_new_tokens=1)
            assert getattr(result, "passages_hit", 0) == 0, f"{name} had seen a passage"
            rows[name].add_run(result.ttft_ms, result.token_ids, 0.0)
            rows[name].add_peak(peak)
            rows[name].reuse.append(result.kv_reuse_ratio)
    base_ttft = median(rows["full prefill"].ttft)
    return {
        "passages_per_prompt": k,
        "queries": n,
        "median_prompt_tokens": median(lengths),
        "systems": {name: summary(row, base_ttft, None) for name, row in rows.items()},
    }
