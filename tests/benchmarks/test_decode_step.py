"""The decode study's step timer (``python -m benchmarks.decode.step``): each part timed and
the engine's attention, linear layers and whole steps computing what transformers does."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.embedded
ROOT = Path(__file__).parents[2]  # `python -m benchmarks...` runs from the checkout


def test_step_report_times_each_part_and_compares_the_attentions(tmp_path) -> None:
    command = [sys.executable, "-m", "benchmarks.decode.step", "--rows", "1,2"]
    command += ["--keys", "64", "--dtype", "float32", "--out", str(tmp_path)]
    command += ["--parts", "attention,linears,mlps"]  # the whole step: on the tiny model below
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "step-float32.json").read_text())
    parts = ("MLPs", "attention", "linear layers", "lm_head")
    assert {(r["part"].split(",")[0].split(":")[0], r["rows"]) for r in report["rows"]} == {
        (part, rows) for part in parts for rows in (1, 2)
    }
    assert all(r["ms"] > 0 for r in report["rows"])
    for row in report["rows"]:
        if "max_diff" in row:  # the engine's single-query attention computes SDPA's result
            assert row["max_diff"] < 1e-5
        if "linear_diff" in row:  # and packed or transposed linear layers F.linear's
            assert row["linear_diff"] < 1e-4
    transposed = [r for r in report["rows"] if r["part"].endswith("W @ x.T")]
    assert len(transposed) == 4 and all("linear_diff" in r for r in transposed)
    assert "few_query_attention" in (tmp_path / "step-float32.txt").read_text()


def test_whole_steps_compiled_and_not_compute_the_same_logits(tmp_path, tiny_model_dir) -> None:
    command = [sys.executable, "-m", "benchmarks.decode.step", "--model", tiny_model_dir]
    command += ["--rows", "1,2", "--keys", "24", "--parts", "whole", "--out", str(tmp_path)]
    done = subprocess.run(
        command + ["--dtype", "float32"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "step-float32.json").read_text())
    labels = ["the engine's", "StaticCache"]
    labels += ["StaticCache, SDPA, compiled", "StaticCache, eager attention, compiled"]
    row_compiled = "the engine's row, eager attention, compiled"  # one row only
    assert [(r["part"].split(": ", 1)[1], r["rows"]) for r in report["rows"]] == [
        *((label, 1) for label in [*labels, row_compiled]),
        *((label, 2) for label in labels),
    ]
    assert all(r["ms"] > 0 for r in report["rows"])
    for row in report["rows"]:
        label = row["part"].split(": ", 1)[1]
        if label == "the engine's":
            assert row["ms"] == pytest.approx(statistics.mean(row["ms_before_after"]))
        if label.endswith("compiled"):
            assert row["compile_s"] > 0
        # the engine's step and the compiled ones give transformers' own logits (fp32)
        if label != "StaticCache":
            assert row["logits_diff"] < 1e-4
    assert "logits' max |diff| from StaticCache's" in (tmp_path / "step-float32.txt").read_text()
