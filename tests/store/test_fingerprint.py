import torch
from conftest import make_model, make_tokenizer

from kvboost_rag.core.store.fingerprint import model_fingerprint


def test_same_model_same_fingerprint(tokenizer) -> None:
    assert model_fingerprint(make_model("llama"), tokenizer) == model_fingerprint(
        make_model("llama"), tokenizer
    )


def test_weights_dtype_arch_and_tokenizer_change_it(tokenizer) -> None:
    base = model_fingerprint(make_model("llama"), tokenizer)
    assert model_fingerprint(make_model("llama", seed=1), tokenizer) != base
    assert model_fingerprint(make_model("llama").to(torch.bfloat16), tokenizer) != base
    assert model_fingerprint(make_model("qwen2"), tokenizer) != base
    other = make_tokenizer()
    other.add_tokens(["<extra>"])
    assert model_fingerprint(make_model("llama"), other) != base
