"""The load benchmark's quick run on the embedded model: the report's structure and its
numbers agreeing with each other (no speed asserted: the machines here are shared)."""

import json
import subprocess
import sys

import pytest

from kvboost_rag.bench.load.report import summarize
from kvboost_rag.cli.main import BENCHES

pytestmark = pytest.mark.embedded
SYSTEMS = ["batched", "serialized", "HuggingFacePipeline"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("load")
    command = ["bench", "load", "--quick", "--threads", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "kvboost_rag.cli", *command], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "load-float32.png").stat().st_size > 0
    table = (out / "load-float32.txt").read_text()
    assert all(f"| {name} | 2 |" in table for name in SYSTEMS)
    return json.loads((out / "load-float32.json").read_text())


def test_every_system_ran_every_level_with_distinct_questions(report: dict) -> None:
    levels = report["settings"]["levels"]
    assert levels == [1, 2] and report["warm"]["batched"]["max_batch_size"] == 8
    assert report["warm"]["serialized"]["max_batch_size"] == 1
    assert [(r["system"], r["level"]) for r in report["runs"]] == [
        (s, n) for n in levels for s in SYSTEMS
    ]
    for level in levels:
        runs = [r for r in report["runs"] if r["level"] == level]
        asked = [[q["question"] for q in r["requests"]] for r in runs]
        assert all(len(a) == level and a == asked[0] for a in asked)  # the same requests
    questions = [
        q["question"] for r in report["runs"] if r["system"] == "batched" for q in r["requests"]
    ]
    assert len(set(questions)) == len(questions) == sum(levels)


def test_request_times_and_tokens_are_consistent(report: dict) -> None:
    most = report["settings"]["max_new_tokens"]
    for run in report["runs"]:
        assert min(q["start_ms"] for q in run["requests"]) == 0
        for q in run["requests"]:
            assert 0 < q["ttft_ms"] <= q["ttlt_ms"]
            assert q["end_ms"] == pytest.approx(q["start_ms"] + q["ttlt_ms"])
            if run["system"] == "HuggingFacePipeline":
                assert q["ttft_ms"] == q["ttlt_ms"]  # a batch is not streamed
            else:
                assert 1 <= q["tokens"] <= most and q["text"]


def test_batched_answers_equal_serialized_answers(report: dict) -> None:
    for run in report["runs"]:
        if run["system"] != "HuggingFacePipeline":
            assert all(q["same_as_serialized"] for q in run["requests"]), run["system"]


def test_rows_summarize_the_runs(report: dict) -> None:
    rows = report["rows"]
    assert rows == summarize(report["runs"])
    for row in rows:
        runs = [
            r for r in report["runs"] if (r["system"], r["level"]) == (row["system"], row["level"])
        ]
        assert row["tokens"] == sum(q["tokens"] for r in runs for q in r["requests"])
        assert row["requests"] == row["level"] * report["settings"]["rounds"]
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        assert row["ttft_p50_ms"] <= row["ttft_p90_ms"] and row["ttlt_p50_ms"] <= row["ttlt_p90_ms"]
        assert 0 <= row["same_answers"] <= row["requests"]
        if row["system"] == "serialized":
            assert row["speedup"] == 1 and row["same_answers"] == row["requests"]


def test_load_is_a_bench_workload() -> None:
    assert BENCHES["load"] == "load.run"
