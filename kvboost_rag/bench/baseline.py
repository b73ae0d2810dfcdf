"""Full prefill with plain ``model.generate`` — what HuggingFacePipeline / HuggingFaceLLM do.

Timed the same way as the engine: from the call (tokenization included) to the first token.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.core.streaming import TokenCollector


@dataclass(frozen=True)
class BaselineRun:
    token_ids: list[int]
    ttft_ms: float
    total_ms: float

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / ((self.total_ms - self.ttft_ms) / 1e3) if n > 0 else 0.0


def full_prefill(model: Any, tokenize: Callable[[], list[int]], max_new_tokens: int) -> BaselineRun:
    """Greedy decode with no cache reuse at all; ``tokenize`` runs inside the timing."""
    start = time.perf_counter()
    ids = torch.tensor([tokenize()])
    collector = TokenCollector()
    with torch.inference_mode():
        model.generate(
            ids.to(model.device),
            attention_mask=torch.ones_like(ids).to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            streamer=collector,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    end = time.perf_counter()
    first = collector.first_token_at or end
    return BaselineRun(collector.token_ids, (first - start) * 1e3, (end - start) * 1e3)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write_report(out: Path, name: str, report: dict[str, Any]) -> Path:
    """Write a benchmark's JSON under ``out`` and say where."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return path
