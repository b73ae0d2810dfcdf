"""Per-system measurements of one workload and their summary (medians, p90, ratios)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost_rag.bench.common.memory import PeakMemory


@dataclass
class Row:
    """Everything measured for one system over one workload's requests."""

    ttft: list[float] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    reuse: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    peak_mib: list[float] = field(default_factory=list)  # per request, above its start
    total_mib: list[float] = field(default_factory=list)  # per request, absolute

    def add_run(self, ttft_ms: float, token_ids: list[int], decode_ms: float) -> None:
        self.ttft.append(ttft_ms)
        if len(token_ids) > 1 and decode_ms > 0:
            self.decode_tok_s.append((len(token_ids) - 1) / (decode_ms / 1e3))

    def add_peak(self, peak: PeakMemory) -> None:
        if peak.mib is not None and peak.total_mib is not None:
            self.peak_mib.append(peak.mib)
            self.total_mib.append(peak.total_mib)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: Sequence[float]) -> float:
    """The 90th percentile by nearest rank: the smallest value at least 90% of the values
    are at or below (with fewer than 10 values, the worst)."""
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1] if ordered else float("nan")


def kl_div(ref: torch.Tensor, ours: torch.Tensor) -> float:
    """KL(reference || ours) of the next-token distributions, in nats."""
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
    return float((p.exp() * (p - q)).sum())


def _pct(xs: Sequence[bool | float]) -> float | None:
    return 100 * sum(xs) / len(xs) if xs else None


def summary(row: Row, base_ttft: float, floor: float | None) -> dict[str, Any]:
    """One system's line: ratios against full prefill (``base_ttft``) and the floor."""
    ttft = median(row.ttft)
    return {
        "median_ttft_ms": ttft,
        "p90_ttft_ms": p90(row.ttft),
        "speedup": base_ttft / ttft,
        "vs_floor": ttft / floor if floor else None,
        "top1_agreement_pct": _pct(row.top1),
        "mean_kl": sum(row.kl) / len(row.kl) if row.kl else None,
        "greedy16_match_pct": _pct(row.greedy),
        "accuracy_pct": _pct(row.correct),
        "reuse_pct": _pct(row.reuse),
        "decode_tok_s": median(row.decode_tok_s) if row.decode_tok_s else None,
        "peak_request_mib": max(row.peak_mib) if row.peak_mib else None,
        "peak_process_mib": max(row.total_mib) if row.total_mib else None,
    }
