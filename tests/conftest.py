"""Shared fixtures: a byte-level tokenizer and tiny random fp32 models (no downloads)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvboost_rag import KVBoost, KVBoostConfig

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus chat specials (ids 0..3).

    Printable-only output keeps decoded text valid, so stop strings behave as on real models.
    """
    alphabet = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level space, \n
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _tiny_kwargs(vocab: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def make_model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    vocab = len(make_tokenizer())
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_tiny_kwargs(vocab)))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_tiny_kwargs(vocab), use_sliding_window=False))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; scale up so greedy outputs are decisive.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.to(torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(params=["llama", "qwen2"])
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def engine(arch: str, tokenizer: PreTrainedTokenizerFast) -> KVBoost:
    return KVBoost(make_model(arch), tokenizer, KVBoostConfig(block_tokens=8))


@pytest.fixture(scope="session")
def embedded() -> KVBoost:
    """The embedded SmolLM2 in fp32 (converted once per machine, then cached)."""
    return KVBoost.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
