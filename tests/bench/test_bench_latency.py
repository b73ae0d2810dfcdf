"""The latency and decode benchmarks' quick runs on the embedded model: the reports'
structure and their numbers agreeing with each other (no speed asserted: the machines here
are shared)."""

import json
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.embedded


def run(name: str, out, *more: str) -> dict:  # type: ignore[no-untyped-def]
    command = [sys.executable, "-m", "kvboost_rag.cli", "bench", name, "--quick", "--out", str(out)]
    # fp32: greedy answers are compared token for token (bf16 kernels may break ties apart)
    command += ["--threads", "1", "--dtype", "float32", *more]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = [json.loads(p.read_text()) for p in out.glob(f"{name}-*.json")]
    weights = report.get("weights", "checkpoint")
    stem = report["machine"]["dtype"] + ("" if weights == "checkpoint" else f"-{weights}")
    assert (out / f"{name}-{stem}.png").stat().st_size > 0
    return report


def test_latency_report_holds_every_system_and_its_ratios(tmp_path) -> None:
    report = run("latency", tmp_path)
    systems = ["generate", "prefix cache", "exact", "balanced", "fast"]
    lengths = report["settings"]["lengths"]
    cells = {(s["scenario"], s["length"]) for s in report["summary"]}
    assert cells == {(c, n) for c in ("warm", "cold") for n in lengths}
    for row in report["rows"]:
        assert sorted(row["runs"]) == sorted(systems)
        for r in row["runs"].values():
            assert 0 < r["ttft_ms"] <= r["ttlt_ms"]
            assert len(r["token_ids"]) == row["length"]  # min_new_tokens held every system
            assert 0 <= r["reused"] < r["prompt"]
        assert row["runs"]["exact"]["token_ids"] == row["runs"]["generate"]["token_ids"]
    for line in report["summary"]:
        if line["system"] == "generate":
            assert line["ttft_ms_x"] == pytest.approx(1.0) and line["same"] == line["requests"]
            assert line["ttft_ms_paired_x"] == pytest.approx(1.0)
        cell = (line["scenario"], line["length"])
        pairs = [
            r["runs"]["generate"]["ttlt_ms"] / r["runs"][line["system"]]["ttlt_ms"]
            for r in report["rows"]
            if (r["scenario"], r["length"]) == cell
        ]
        assert line["ttlt_ms_paired_x"] == pytest.approx(statistics.median(pairs))


def test_latency_runs_on_the_weights_asked_for(tmp_path) -> None:
    report = run("latency", tmp_path, "--weights", "int8")
    assert report["weights"] == "int8" and (tmp_path / "latency-float32-int8.json").exists()
    for row in report["rows"]:  # generate and the engine on the same quantized model
        assert row["runs"]["exact"]["token_ids"] == row["runs"]["generate"]["token_ids"]


def test_decode_report_counts_what_each_system_generated(tmp_path) -> None:
    report = run("decode", tmp_path)
    assert report["peers_run"] == {"llama.cpp": False, "vLLM-CPU": False}
    names = {"ours", "ours, no drafts", "generate", "generate + prompt lookup"}
    names |= {"ours, warm balanced", "ours, warm fast"}
    assert {s["system"] for s in report["summary"]} == names
    for run_ in report["runs"]:
        assert len(run_["requests"]) == run_["level"]
        for request in run_["requests"]:
            assert len(request["ids"]) == run_["length"] and request["ttft"] <= request["ttlt"]
    for line in report["summary"]:
        # speculation and the one decode path never change a greedy answer (one at a time;
        # a padded batch of generate's computes in another order)
        if line["system"] in ("ours", "ours, no drafts") and line["level"] == 1:
            assert line["same"] == line["compared"] == line["requests"]


def test_step_report_times_each_part_and_compares_the_attentions(tmp_path) -> None:
    command = [sys.executable, "-m", "kvboost_rag.cli", "bench", "step", "--rows", "1,2"]
    command += ["--keys", "64", "--dtype", "float32", "--out", str(tmp_path)]
    command += ["--parts", "attention,linears,mlps"]  # the whole step: on the tiny model below
    done = subprocess.run(command, capture_output=True, text=True)
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
    command = [sys.executable, "-m", "kvboost_rag.cli", "bench", "step", "--model", tiny_model_dir]
    command += ["--rows", "1,2", "--keys", "24", "--parts", "whole", "--out", str(tmp_path)]
    done = subprocess.run(command + ["--dtype", "float32"], capture_output=True, text=True)
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
