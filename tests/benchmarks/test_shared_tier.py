"""The shared-tier benchmarks load and describe themselves (their record runs take minutes:
docs/bench/remote-float32.txt and docs/bench/faults.txt hold them)."""

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("module", ["remote", "faults", "cluster"])
def test_bench_help(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--help"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],  # a study runs from the checkout's root
    )
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--quick" in done.stdout


def test_recorded_runs_show_no_wrong_serve_and_no_encoding() -> None:
    import json
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "docs" / "bench"
    faults = json.loads((bench / "faults.json").read_text())
    rows = faults["rows"]
    assert len(rows) >= 10 and all(r["wrong"] == 0 and not r["raised"] for r in rows)
    assert all(r["completed"] == r["attempted"] for r in rows)
    remote = json.loads((bench / "remote-float32.json").read_text())
    assert remote["serve"]["redis"]["passages_encoded"] == 0


def test_recorded_cluster_runs_batch_spread_and_serve_nothing_wrong() -> None:
    import json
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "docs" / "bench"
    run = json.loads((bench / "cluster.json").read_text())
    assert len(run["keys_per_master"]) == 3 and all(run["keys_per_master"].values())
    for topology in run["topologies"].values():
        assert topology["loopback"]["check"]["passages_missed"] == 0  # nothing encoded
        for network in ("loopback", "+1 ms RTT"):
            modes = topology[network]["modes"]
            assert max(modes["batched"]["round_trips"]) < min(modes["per entry"]["round_trips"])
            assert modes["batched"]["passages_found"] == 7
    rows = json.loads((bench / "faults-cluster.json").read_text())["rows"]
    assert len(rows) >= 5 and all(r["wrong"] == 0 and not r["raised"] for r in rows)
    assert all(r["completed"] == r["attempted"] and r["warnings"] <= 1 for r in rows)


def test_the_encode_counter_counts_every_passage_encoded(tokenizer) -> None:
    """The remote study's "0 passages encoded" means something: its counter sees each
    passage the engine encodes (it once wrapped a method the engine no longer called)."""
    from conftest import make_model

    from benchmarks.remote.serve import count_encoded
    from kvboost_rag import KVBoost, KVBoostConfig

    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8))
    texts = [f"Passage {i}: the {w} crossed the river at dawn." for i, w in enumerate("abc")]
    with count_encoded(engine) as encoded:
        engine.warm_passages(texts)
        engine.generate("Question?", passages=texts[:2], max_new_tokens=2)  # both cached
    assert encoded == [3]
