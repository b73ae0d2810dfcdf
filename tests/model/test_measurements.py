"""What a start measured, kept per machine and model and recalled by the next start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model import arch, attention_choice, linears, measurements, packed
from kvboost_rag.core.model.measurements import Measurements

KEY = {"dtype": "torch.bfloat16", "linears": [[[64, 64, False], 3]]}


def test_a_kept_value_is_recalled_under_the_same_key_only(tmp_path: Path) -> None:
    kept = Measurements(tmp_path)
    kept.keep("linears", KEY, [{"8": "packed"}, {}])
    assert Measurements(tmp_path).recall("linears", KEY) == [{"8": "packed"}, {}]
    assert Measurements(tmp_path).recall("linears", {**KEY, "dtype": "torch.float32"}) is None
    assert Measurements(tmp_path).recall("head", KEY) is None
    assert Measurements(None).recall("linears", KEY) is None


def test_a_change_of_machine_or_software_measures_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Measurements(tmp_path).keep("linears", KEY, [{}, {}])
    uncached = measurements.machine.__wrapped__  # reads the environment again
    here = measurements.machine()
    for field, other in (("torch", "9.9.9"), ("cpu_flags", "0" * 24), ("cpu", "another CPU")):
        monkeypatch.setattr(measurements, "machine", lambda f=field, o=other: {**here, f: o})
        assert Measurements(tmp_path).recall("linears", KEY) is None, field
    monkeypatch.setattr(measurements, "machine", lambda: here)
    with monkeypatch.context() as env:
        env.setenv("OMP_WAIT_POLICY", "PASSIVE" if "ACTIVE" in here["openmp"] else "ACTIVE")
        env.setattr(measurements, "machine", uncached)
        assert Measurements(tmp_path).recall("linears", KEY) is None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert Measurements(tmp_path).recall("linears", KEY) is None
    finally:
        torch.set_num_threads(threads)
    assert Measurements(tmp_path).recall("linears", KEY) == [{}, {}]


def test_a_damaged_entry_counts_as_missing(tmp_path: Path) -> None:
    kept = Measurements(tmp_path)
    kept.keep("linears", KEY, [{}, {}])
    (entry,) = tmp_path.glob("linears-*.json")
    entry.write_text('{"key": ')
    assert kept.recall("linears", KEY) is None
    entry.write_text("[1, 2]")
    assert kept.recall("linears", KEY) is None


def engine_on(model: torch.nn.Module, tokenizer: Any, **config: Any) -> KVBoost:
    return KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact", **config))


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """The start's measurements timed on the tiny model (its products are too small to be
    timed otherwise) and counted; kept under ``tmp_path``."""
    monkeypatch.setattr(measurements, "default_folder", lambda: tmp_path / "kept")
    monkeypatch.setattr(arch, "KEPT_PARAMETERS", 0)
    monkeypatch.setattr(linears, "MEASURED_BYTES", 0)
    monkeypatch.setattr(packed, "MEASURED_ELEMENTS", 0)
    counts = {"ranked": 0, "head": 0, "rotation": 0, "attention": 0}

    def ranked(layers: Any, count: int, ways: Any) -> list[str]:
        counts["ranked"] += 1
        return [linears.TRANSPOSED if count <= 8 else linears.PLAIN, *ways]

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            counts[name] += 1
            return fn(*args)

        return wrapper

    monkeypatch.setattr(linears, "_ranked", ranked)
    monkeypatch.setattr(packed.PackedHead, "_check", counted("head", packed.PackedHead._check))
    monkeypatch.setattr(arch, "rotation_errors", counted("rotation", arch.rotation_errors))
    monkeypatch.setattr(attention_choice, "faster", counted("attention", attention_choice.faster))
    return counts


def test_a_second_start_recalls_what_the_first_measured(
    timed: dict[str, int], tokenizer: Any, tmp_path: Path
) -> None:
    first = engine_on(make_model("llama"), tokenizer)
    assert timed["ranked"] > 0 and timed["head"] == 1 and timed["rotation"] == 1
    assert timed["attention"] == 1
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "kept").iterdir())
    assert kept == ["attention", "head", "linears", "rotation"]
    timed.update(ranked=0, head=0, rotation=0, attention=0)
    second = engine_on(make_model("llama"), tokenizer)  # another process's model, same weights
    assert timed == {"ranked": 0, "head": 0, "rotation": 0, "attention": 0}
    runner = second._handle.executor.batch.runner
    assert runner.few == first._handle.executor.batch.runner.few
    runner = second._handle.executor.batch.runner
    assert runner.ways == first._handle.executor.batch.runner.ways
    assert runner.ways.fastest == dict.fromkeys((1, 2, 4, 8), linears.TRANSPOSED)
    assert second.support.passage_reuse == first.support.passage_reuse
    want = first.generate("one two three", max_new_tokens=5).token_ids
    assert second.generate("one two three", max_new_tokens=5).token_ids == want


def test_other_weights_or_dtype_measure_again(timed: dict[str, int], tokenizer: Any) -> None:
    engine_on(make_model("llama"), tokenizer)
    timed.update(ranked=0, head=0, rotation=0)
    engine_on(make_model("llama", seed=1), tokenizer)  # same shapes: only the ways recalled
    assert timed["ranked"] == 0 and timed["head"] == 1 and timed["rotation"] == 1
    timed.update(ranked=0, head=0, rotation=0)
    engine_on(make_model("llama").to(torch.bfloat16), tokenizer)
    assert timed["ranked"] > 0 and timed["rotation"] == 1


def test_remember_measurements_false_measures_at_every_start(
    timed: dict[str, int], tokenizer: Any, tmp_path: Path
) -> None:
    for _ in range(2):
        timed.update(ranked=0, head=0, rotation=0)
        engine_on(make_model("llama"), tokenizer, remember_measurements=False)
        assert timed["ranked"] > 0 and timed["head"] == 1 and timed["rotation"] == 1
    assert not (tmp_path / "kept").exists()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_remember_measurements_takes_a_bool(value: object) -> None:
    with pytest.raises(ValueError, match="remember_measurements must be True or False"):
        KVBoostConfig(remember_measurements=value)  # type: ignore[arg-type]
