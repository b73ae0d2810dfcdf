"""Every study in ``benchmarks/`` still runs from a checkout: one end-to-end run each, as a
user runs it (``python -m benchmarks.<name>`` from the repository root), on the smallest
arguments it takes and a temporary ``--out``. Slow (minutes in all): ``pytest -m slow``.
No timing is asserted; the runs' reports are checked where a study's own test does not
already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def study(name: str, *args: str, timeout: float = 1200) -> str:
    """``python -m benchmarks.<name> *args`` from the checkout; its stdout."""
    command = [sys.executable, "-m", f"benchmarks.{name}", *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def one_json(out: Path, pattern: str) -> dict[str, Any]:
    (path,) = out.glob(pattern)
    return json.loads(path.read_text())


def test_agent(tmp_path: Path) -> None:
    args = ["--chunks", "8", "--chunk-tokens", "64", "--k", "2", "--max-tokens", "8"]
    study("agent", *args, "--frameworks", "langchain", "--no-probe", "--out", str(tmp_path))
    steps = one_json(tmp_path, "agent.json")["frameworks"]["langchain"]["steps"]
    assert steps and all(s["prompt_tokens"] > 0 and s["full_prefill_ttft_ms"] > 0 for s in steps)


def test_chat(tmp_path: Path) -> None:
    study("chat", "--repeats", "1", "--max-new-tokens", "2", "--out", str(tmp_path))
    assert list(tmp_path.glob("chat*.json"))


def test_cluster(tmp_path: Path) -> None:
    from redis_server import require_binary

    require_binary("redis-cli")
    study("cluster", "--quick", "--prompts", "1", "--out", str(tmp_path))
    run = json.loads((tmp_path / "cluster.json").read_text())
    server = run["topologies"]["one server"]["loopback"]["modes"]
    assert server["batched"]["round_trips"] == [2]  # the prefix chain, then the passages
    assert server["per entry"]["round_trips"][0] > 7  # a round trip per passage, and more
    assert "keys per cluster master" in (tmp_path / "cluster.txt").read_text()


def test_constrained(tmp_path: Path) -> None:
    args = ["--repeats", "1", "--max-new-tokens", "16", "--limit", "1"]
    study("constrained", *args, "--out", str(tmp_path))
    assert list(tmp_path.glob("constrained*.json"))


def test_decode(tmp_path: Path) -> None:
    # fp32: greedy answers are compared token for token (bf16 kernels may break ties apart)
    args = ["--quick", "--threads", "1", "--dtype", "float32", "--out", str(tmp_path)]
    study("decode", *args)
    report = one_json(tmp_path, "decode-*.json")
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
    assert (tmp_path / "decode-float32.png").stat().st_size > 0


def test_exactness(tmp_path: Path) -> None:
    args = ["--requests", "1", "--new-tokens", "2", "--dtypes", "float32", "--threads", "1"]
    study("exactness", *args, "--out", str(tmp_path))
    assert list(tmp_path.glob("exactness*.json"))


def test_faults(tmp_path: Path) -> None:
    from redis_server import require_binary

    require_binary("redis-server")
    study("faults", "--quick", "--passages", "4", "--queries", "1", "--out", str(tmp_path))
    assert list(tmp_path.glob("faults*.json"))


def test_front(tiny_dir: Path, tmp_path: Path) -> None:
    args = ["--quick", "--dtype", "float32", "--model", str(tiny_dir), "--tasks", "fact"]
    study("front", *args, "--out", str(tmp_path))
    assert list(tmp_path.glob("front*.json"))


def test_rag(tmp_path: Path) -> None:
    args = ["--queries", "1", "--sizes", "3", "--dtype", "float32", "--out", str(tmp_path)]
    study("rag", *args)
    assert list(tmp_path.glob("*.json"))


def test_remote(tmp_path: Path) -> None:
    from redis_server import require_binary

    require_binary("redis-server")
    study("remote", "--quick", "--dtype", "float32", "--out", str(tmp_path))
    assert list(tmp_path.glob("remote*.json"))


def test_suite(tiny_dir: Path, tmp_path: Path) -> None:
    args = ["--quick", "--dtype", "float32", "--model", str(tiny_dir), "--no-peer"]
    study("suite", *args, "--out", str(tmp_path))
    assert list(tmp_path.rglob("*.json"))


def test_tools(tmp_path: Path) -> None:
    args = ["--model", "smollm2-135m-instruct", "--dtype", "float32", "--limit", "1"]
    study("tools", *args, "--routes", "engine forced", "--max-tokens", "16", "--out", str(tmp_path))
    assert list(tmp_path.glob("tools*.json"))
