"""A cache folder warmed by another model (other weights, a fine-tune, another dtype,
another vocabulary, another chat template) is never served to this one: every answer
equals a no-cache engine's (greedy, fp32, identical tokens)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer
from disk_setup import engine, files, warmed
from fault_worker import DOCS, answers, config
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from kvboost_rag import KVBoost, format_passages

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def permuted_tokenizer() -> PreTrainedTokenizerFast:
    """The test tokenizer with two letters' ids swapped: same size, other ids."""
    tok = make_tokenizer()
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    other.chat_template = tok.chat_template
    assert other("a e").input_ids == tok("e a").input_ids
    return other


def other_model(kind: str) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    model, tokenizer = make_model("llama"), make_tokenizer()
    if kind == "weights":
        model = make_model("llama", seed=1)
    elif kind == "finetune":  # one layer's keys nudged, as a small fine-tune would
        with torch.no_grad():
            weight = model.model.layers[1].self_attn.k_proj.weight
            weight.add_(1e-3 * torch.randn_like(weight))
    elif kind in ("bfloat16", "float16"):
        model = model.to(getattr(torch, kind))
    else:
        assert kind == "vocab"
        tokenizer = permuted_tokenizer()
    return model, tokenizer


@pytest.mark.parametrize("kind", ["weights", "finetune", "bfloat16", "float16", "vocab"])
def test_a_folder_warmed_by_another_model_is_never_used(tmp_path: Path, kind: str) -> None:
    warmed(tmp_path)
    model, tokenizer = other_model(kind)
    own = answers(KVBoost(model, tokenizer, config(None)))
    served = engine(tmp_path, model, tokenizer, memory=10**9)  # reads disk on misses only
    assert served.fingerprint != engine(tmp_path).fingerprint
    assert answers(served) == own
    stats = served.stats().disk
    assert (stats.hits, stats.corrupt) == (0, 0)


def tokens_of(path: Path) -> tuple[int, ...]:
    return tuple(load_file(path)["tokens"].tolist())


def test_another_models_files_under_this_models_names(tmp_path: Path) -> None:
    """Keys fold in the fingerprint, so another model's files are never even looked up;
    copied under this model's names (same token ids), their metadata rejects them."""
    foreign = {tokens_of(path): path for path in files(warmed(tmp_path / "a"))}
    model, tokenizer = other_model("weights")
    warmed(tmp_path / "b", model, tokenizer)
    planted = 0
    for path in files(tmp_path / "b"):
        if (twin := foreign.get(tokens_of(path))) is not None:
            shutil.copyfile(twin, path)
            planted += 1
    assert planted > 0
    own = answers(KVBoost(model, tokenizer, config(None)))
    served = engine(tmp_path / "b", model, tokenizer, memory=10**9)
    with pytest.warns(UserWarning, match="fingerprint does not match"):
        assert answers(served) == own
    stats = served.stats().disk
    assert stats.hits == 0 and stats.corrupt > 0


def test_another_chat_template_uses_only_what_its_own_tokens_match(tmp_path: Path) -> None:
    """The chat template is not in the fingerprint: KV is a function of token ids, and a
    template that renders other tokens gets other keys."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": format_passages(DOCS[:3]) + "Which code?"},
    ]
    first = engine(tmp_path)
    first.chat(messages, max_new_tokens=4)
    first.flush()
    assert files(tmp_path)
    tokenizer = make_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    own = KVBoost(make_model("llama"), tokenizer, config(None)).chat(messages, max_new_tokens=4)
    served = engine(tmp_path, tokenizer=tokenizer, memory=10**9)
    assert served.fingerprint == first.fingerprint
    assert served.chat(messages, max_new_tokens=4).token_ids == own.token_ids
    assert served.stats().disk.hits == 0
