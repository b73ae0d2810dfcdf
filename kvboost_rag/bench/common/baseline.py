"""Full prefill with plain ``model.generate`` — what HuggingFacePipeline / HuggingFaceLLM do.

Timed the same way as the engine: from the call (tokenization included) to the first token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer


class TokenCollector(BaseStreamer):
    """``generate``'s streamer: the first token's time and every generated id (it is
    first handed the prompt, then one tensor per new token)."""

    def __init__(self) -> None:
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_ids: list[int] = []
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        self.last_token_at = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at
        self.token_ids.extend(int(t) for t in value.reshape(-1).tolist())

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class BaselineRun:
    token_ids: list[int]
    ttft_ms: float
    total_ms: float
    first_logits: torch.Tensor | None = None  # the first token's logits, when asked for

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / ((self.total_ms - self.ttft_ms) / 1e3) if n > 0 else 0.0


def full_prefill(
    model: Any, tokenize: Callable[[], list[int]], max_new_tokens: int, logits: bool = False
) -> BaselineRun:
    """Greedy decode with no cache reuse at all; ``tokenize`` runs inside the timing.
    With ``logits`` the first token's logits of this very run come back too."""
    start = time.perf_counter()
    ids = torch.tensor([tokenize()])
    collector = TokenCollector()
    with torch.inference_mode():
        out = model.generate(
            ids.to(model.device),
            attention_mask=torch.ones_like(ids).to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            streamer=collector,
            temperature=None,
            top_p=None,
            top_k=None,
            output_logits=logits,
            return_dict_in_generate=logits,
        )
    end = time.perf_counter()
    first = collector.first_token_at or end
    first_logits = out.logits[0][0].float() if logits else None
    return BaselineRun(
        collector.token_ids, (first - start) * 1e3, (end - start) * 1e3, first_logits
    )


def write_report(out: Path, name: str, report: dict[str, Any]) -> Path:
    """Write a benchmark's JSON under ``out`` and say where."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return path
