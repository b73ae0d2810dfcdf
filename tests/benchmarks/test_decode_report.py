"""The decode study's report (``benchmarks/decode/report.py``): every weights kind's systems
are compared to ``generate`` on that model, and the physical limit (bytes a step reads over
the measured bandwidth) stands beside the measured ms per token of ``ours, no drafts`` and
llama.cpp, one request at a time."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.decode.report import add_floor, base_of, summarize, table
from benchmarks.decode.run import parse
from kvboost_rag.core.model.quantized import WEIGHTS

FLOOR = {"read_gb_per_s": 10.0, "buffer_bytes": 1 << 30, "passes": 5,
         "step_bytes": {"checkpoint": 200_000_000, "int4": 50_000_000},
         "gguf_bytes": 100_000_000}  # fmt: skip


def run(system: str, level: int = 1, ttft: float = 100.0, ttlt: float = 500.0) -> dict[str, Any]:
    """One batch of ``level`` requests of 5 tokens each (llama.cpp's without ids)."""
    ids = None if system == "llama.cpp" else [1, 2, 3, 4, 5]
    request = {"start": 0.0, "ttft": ttft, "ttlt": ttlt, "ids": ids, "tokens": 5}
    return {"length": 5, "kind": "extractive", "level": level, "batch": 0, "system": system,
            "requests": [dict(request) for _ in range(level)]}  # fmt: skip


@pytest.mark.parametrize("weights", WEIGHTS)
def test_every_weights_kind_is_compared_to_generate_on_its_model(weights: str) -> None:
    assert base_of(f"ours, no drafts, {weights}") == f"generate, {weights}"
    assert parse(["--weights", f"checkpoint,{weights}"]).weights == [None, weights]
    assert base_of("ours, no drafts") == "generate"


def test_the_floor_stands_beside_the_measured_ms_per_token_at_one_request() -> None:
    systems = ["ours, no drafts", "ours, no drafts, int4", "ours", "llama.cpp", "generate"]
    runs = [run(s) for s in systems] + [run("ours, no drafts", level=2)]
    summary = summarize(runs)
    add_floor(summary, FLOOR)
    lines = {(s["system"], s["level"]): s for s in summary}
    assert lines["ours, no drafts", 1]["ms_per_token"] == 100.0  # (500 - 100) / (5 - 1)
    floors = {name: lines[name, 1]["floor_ms"] for name in systems}
    assert floors == {"ours, no drafts": 20.0, "ours, no drafts, int4": 5.0, "ours": None,
                      "llama.cpp": 10.0, "generate": None}  # fmt: skip
    assert lines["ours, no drafts, int4", 1]["floor_x"] == 20.0
    assert lines["ours, no drafts", 2]["floor_ms"] is None  # steps shared between requests
    assert lines["ours, no drafts", 2]["ms_per_token"] is None


def test_the_table_prints_the_floor() -> None:
    summary = summarize([run("ours, no drafts"), run("generate")])
    add_floor(summary, FLOOR)
    machine = {"dtype": "float32", "cpu": "a CPU", "cpu_count": 2, "threads": 2,
               "torch": "2", "transformers": "5"}  # fmt: skip
    report = {"model": "m", "machine": machine, "command": "c", "peers_run": {},
              "summary": summary, "floor": FLOOR}  # fmt: skip
    text = table(report)
    assert "read bandwidth 10.0 GB/s" in text and "checkpoint 200 MB" in text
    row = next(line for line in text.splitlines() if line.startswith("ours, no drafts"))
    assert row.split()[-3:] == ["100.0", "20.0", "5.00"]
