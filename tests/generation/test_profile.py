"""The speed profile: what makes a model's forwards fast, read back as the engine made it,
and steered through explicit channels only (no context variables, no module globals, the
user's model untouched)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model.footprint import step_bytes
from kvboost_rag.core.model.quantized import quantize

CORE = Path(__file__).resolve().parents[2] / "core"


def test_a_plain_engine_reads_back_its_choices(tokenizer: Any) -> None:
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(fidelity="exact"))
    engine.generate("one two three", max_new_tokens=3)
    profile = engine._handle.profile()
    assert (profile.device, profile.dtype, profile.weights) == ("cpu", "float32", "checkpoint")
    assert profile.linear_ways == {} and not profile.packed_linears  # too small to measure
    assert profile.attention.startswith("kvboost_sdpa")
    assert profile.compiled_step == "off"
    assert profile.drafts == "a lone row feeds every draft"


@pytest.mark.usefixtures("packed_up_to_8_rows")
def test_measured_ways_and_quantized_weights_show(tokenizer: Any) -> None:
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(fidelity="exact"))
    profile = engine._handle.profile()
    assert profile.linear_ways == dict.fromkeys((1, 2, 4, 8), "packed")
    assert profile.packed_linears
    model = make_model("llama")
    quantize(model, "int8")
    profile = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))._handle.profile()
    assert profile.weights == "int8" and "quantized" in profile.drafts


def test_the_bytes_a_step_reads_are_the_engine_models(tokenizer: Any) -> None:
    model = make_model("llama")
    dense = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))._handle.profile()
    assert dense.step_bytes == step_bytes(model)
    quantize(model, "int4")
    profile = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))._handle.profile()
    assert profile.step_bytes == step_bytes(model) < dense.step_bytes


def test_an_eager_model_is_said_to_run_eager(tokenizer: Any) -> None:
    model = make_model("llama")
    model.set_attn_implementation("eager")
    assert KVBoost(model, tokenizer)._handle.profile().attention == "eager"


@pytest.mark.parametrize("folder", ["model", "generation"])
def test_no_context_variable_or_module_global_steers_a_forward(folder: str) -> None:
    """The forwards' steering is explicit: no ``ContextVar`` in the model and generation
    layers, and no function rebinds a module global there."""
    for path in sorted((CORE / folder).glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {
            n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(tree)
            if isinstance(n, (ast.Name, ast.Attribute))
        }
        assert "ContextVar" not in names, path.name
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], path.name


def test_the_engine_never_swaps_a_class() -> None:
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets = [t for t in node.targets if isinstance(t, ast.Attribute)]
                assert all(t.attr != "__class__" for t in targets), path.name


def test_the_engine_model_shares_every_tensor(tokenizer: Any) -> None:
    model = make_model("qwen2")
    quantize(model, "int4")
    engine = KVBoost(model, tokenizer)
    view = engine._handle.engine_model
    ours = {id(t) for t in (*view.parameters(), *view.buffers())}
    theirs = {id(t) for t in (*model.parameters(), *model.buffers())}
    assert ours == theirs  # no tensor copied, and every one the engine runs is the user's
