"""The agent benchmark's pure parts: per-step rows, the summary and the table."""

from __future__ import annotations

from benchmarks.agent.loop import same_answer
from benchmarks.agent.run import summary, table
from kvboost_rag.core.results import GenerationResult
from kvboost_rag.core.tools.formats import ToolCall


def result(text: str = "", calls: list[ToolCall] | None = None) -> GenerationResult:
    return GenerationResult(text, [1], "stop", 10, 5, 5, 1.0, 2.0, tool_calls=calls or [])


def row(reuse: float, ttft: float, full: float, same: bool = True) -> dict:
    return {
        "tool_choice": "auto",
        "calls": ["search_essays"],
        "invalid_calls": 0,
        "prompt_tokens": 100,
        "reuse": reuse,
        "ttft_ms": ttft,
        "full_prefill_ttft_ms": full,
        "speedup": round(full / ttft, 2),
        "same_as_full_prefill": same,
    }


def test_summary_counts_steps_from_the_second_on() -> None:
    rows = [row(0.0, 500, 500), row(0.95, 100, 600), row(0.85, 150, 650, same=False)]
    s = summary(rows)
    assert s["steps"] == 3 and s["tool_calls"] == 3
    assert s["min_reuse_from_step_2"] == 0.85 and s["steps_from_2_at_90pct"] == 1
    assert s["same_as_full_prefill"] == 2 and s["median_ttft_ms"] == 150


def test_table_has_a_row_per_step_and_the_probes() -> None:
    report = {
        "frameworks": {
            "langchain": {"steps": [row(0.0, 500, 500), row(0.9, 100, 600)], "summary": {}}
        },
        "hf_probes": {"llamaindex HuggingFaceLLM": {"runs": False, "error": "ValueError: x"}},
    }
    text = table(report)
    assert "| 2 | auto | search_essays | 100 | 90% | 100 ms | 600 ms | 6.0x | yes |" in text
    assert "HuggingFaceLLM" in text and "ValueError" in text


def test_same_answer_compares_calls_and_text() -> None:
    call = ToolCall("add", {"a": 1})
    assert same_answer(result("x", [call]), result("x", [ToolCall("add", {"a": 1}, "other")]))
    assert not same_answer(result("x", [call]), result("x", [ToolCall("add", {"a": 2})]))
    assert not same_answer(result("x"), result("y"))
