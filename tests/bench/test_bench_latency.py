"""The latency benchmark's quick runs on the embedded model: the reports'
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
