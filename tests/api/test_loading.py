"""Loading a model: ``KVBoost.from_pretrained`` and the adapters' ``from_model_id`` check
every argument before transformers or torch sees it (issue 28, item 7), and loading prints
no progress bar of transformers' (item 12)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvboost_rag.core.model.stored_weights as loading_module
from kvboost_rag import KVBoost, KVBoostConfig, UnknownModelError

# What a new user passes, and what they must be told, before anything loads.
REFUSED = [
    ({"model": "/no/such/model"}, UnknownModelError, r"unknown model '/no/such/model': no such"),
    ({"model": "./no/such"}, UnknownModelError, r"unknown model './no/such'"),
    ({"model": ""}, UnknownModelError, "model is empty"),
    ({"model": None}, TypeError, "model must be a str"),
    (
        {"fidelity": "fast"},
        TypeError,
        r"fidelity: engine settings, .* pass config=KVBoostConfig\(fidelity='fast'\)",
    ),
    ({"cache_dir": "/tmp/x"}, TypeError, r"config=KVBoostConfig\(cache_dir='/tmp/x'\)"),
    ({"torch_dtype": torch.float32}, TypeError, "pass dtype="),
    ({"dtype": "fp32"}, ValueError, r"dtype must be one of .* got 'fp32' \(did you mean 'float32'"),
    (
        {"dtype": "int8"},
        ValueError,
        "int8 is a storage format, not a compute dtype: quantize the weights with weights='int8'",
    ),
    ({"dtype": torch.int8}, ValueError, "int8 is a storage format"),
    ({"dtype": "float16x"}, ValueError, "dtype must be one of"),
    ({"dtype": 16}, TypeError, "dtype must be a str or a torch.dtype"),
    ({"device": "gpu"}, ValueError, "device 'gpu' is not a torch device"),
    ({"device": 0.5}, TypeError, "device must be a str or a torch.device"),
    ({"config": {"fidelity": "fast"}}, TypeError, "config must be a KVBoostConfig"),
    # Issue 48 row 6: transformers' own ValueError, from modeling_utils, after the
    # tokenizer loaded.
    (
        {"attn_implementation": "bogus"},
        ValueError,
        r"attn_implementation 'bogus' is not an attention transformers has: pass one of "
        r"\(.*'eager'.*'sdpa'.*\)",
    ),
    ({"attn_implementation": "SDPA"}, ValueError, "attn_implementation 'SDPA' is not"),
    ({"attn_implementation": 2}, TypeError, "attn_implementation must be a str, got int"),
]


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load weights fails the test: arguments are checked before."""

    def load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before its arguments were checked")

    monkeypatch.setattr(loading_module, "load_model", load)


@pytest.mark.parametrize("kwargs, error, message", REFUSED)
def test_from_pretrained_refuses_before_loading(
    tiny_model_dir: str, no_loading: None, kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        KVBoost.from_pretrained(**{"model": tiny_model_dir, **kwargs})


@pytest.mark.parametrize(
    "name", ["eager", "sdpa", "paged|eager", "flex_attention", "kernels-community/flash-attn2"]
)
def test_an_attention_transformers_has_passes_the_check(
    tiny_model_dir: str, no_loading: None, name: str
) -> None:
    """Whatever the check lets through goes on to loading (here: the fixture's failure)."""
    with pytest.raises(AssertionError, match="the model was loaded"):
        KVBoost.from_pretrained(tiny_model_dir, attn_implementation=name)


def test_the_model_loads_with_the_attention_asked_for(tiny_model_dir: str) -> None:
    engine = KVBoost.from_pretrained(tiny_model_dir, dtype="float32", attn_implementation="eager")
    assert engine.model.config._attn_implementation == "eager"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_cuda_without_cuda_is_named_before_loading(tiny_model_dir: str, no_loading) -> None:
    with pytest.raises(ValueError, match="device 'cuda' is not available: .* sees no cuda"):
        KVBoost.from_pretrained(tiny_model_dir, device="cuda")


def test_a_folder_that_holds_no_model(tmp_path: Path, no_loading: None) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(UnknownModelError, match="is not a model folder: it has no config.json"):
        KVBoost.from_pretrained(str(tmp_path))
    with pytest.raises(UnknownModelError, match="no such file or folder"):
        KVBoost.from_pretrained(str(tmp_path / "notes.txt" / "x"))


def test_a_folder_under_home_is_found(tiny_model_dir: str, monkeypatch) -> None:
    folder = Path(tiny_model_dir)
    monkeypatch.setenv("HOME", str(folder.parent))
    engine = KVBoost.from_pretrained(f"~/{folder.name}", dtype="float32")
    assert engine.name == f"~/{folder.name}" and engine.model.dtype == torch.float32


def test_an_hf_id_offline_and_not_cached(monkeypatch, no_loading) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UnknownModelError, match="not in the local Hugging Face cache"):
        KVBoost.from_pretrained("nobody-here/no-such-model")


def test_a_model_argument_transformers_does_not_take_is_named(tiny_model_dir: str) -> None:
    with pytest.raises(TypeError, match=r"model_kwargs \['colour'\] go to transformers"):
        KVBoost.from_pretrained(tiny_model_dir, colour="red")


def test_loading_prints_no_progress_bar(tiny_model_dir: str, capfd) -> None:
    engine = KVBoost.from_pretrained(tiny_model_dir, dtype="float32", device="cpu")
    assert engine.model.dtype == torch.float32 and engine.name == tiny_model_dir
    assert "Loading weights" not in capfd.readouterr().err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # put back for the user's own bars


def test_dtype_names_and_torch_dtypes(tiny_model_dir: str) -> None:
    for dtype in ("bfloat16", torch.bfloat16, "torch.bfloat16"):
        assert KVBoost.from_pretrained(tiny_model_dir, dtype=dtype).model.dtype == torch.bfloat16


# -- the adapters' constructors -------------------------------------------------------------


def test_langchain_from_model_id_raises_the_loaders_own_errors(tiny_model_dir: str) -> None:
    from kvboost_rag.integrations.langchain import ChatKVBoost, KVBoostPipeline

    for cls in (ChatKVBoost, KVBoostPipeline):
        # Not a pydantic ValidationError wrapping it: the loader's error, as raised.
        with pytest.raises(UnknownModelError, match="unknown model '/no/such'"):
            cls.from_model_id("/no/such")
        with pytest.raises(ValueError, match="did you mean 'float32'") as caught:
            cls.from_model_id(tiny_model_dir, dtype="fp32")
        assert type(caught.value) is ValueError
    chat = ChatKVBoost.from_model_id(tiny_model_dir, dtype="float32", max_tokens=2)
    assert chat.model_id == tiny_model_dir and chat.invoke("Hi").content is not None


def test_langchain_load_fields_are_strict(tiny_model_dir: str, no_loading: None) -> None:
    """device=b"cpu" was read as "cpu" (found by tests/api/test_fuzz_loading.py)."""
    from pydantic import ValidationError

    from kvboost_rag.integrations.langchain import ChatKVBoost

    for field in ({"device": b"cpu"}, {"dtype": b"float32"}):
        with pytest.raises(ValidationError, match="Input should be a valid string"):
            ChatKVBoost.from_model_id(tiny_model_dir, **field)
    with pytest.raises(ValidationError, match="Input should be a valid string"):
        ChatKVBoost(model_id=tiny_model_dir.encode())


def test_llamaindex_from_model_id_refuses_before_loading(tiny_model_dir: str, no_loading) -> None:
    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    with pytest.raises(UnknownModelError, match="unknown model '/no/such'"):
        KVBoostLLM.from_model_id("/no/such")
    with pytest.raises(TypeError, match=r"pass config=KVBoostConfig\(max_passage_tokens=64\)"):
        KVBoostLLM.from_model_id(tiny_model_dir, model_kwargs={"max_passage_tokens": 64})
    with pytest.raises(ValueError, match="device 'cuda:7' is not available"):
        KVBoostLLM.from_model_id(tiny_model_dir, device="cuda:7")


def test_a_config_is_still_passed_through(tiny_model_dir: str) -> None:
    engine = KVBoost.from_pretrained(tiny_model_dir, config=KVBoostConfig(fidelity="fast"))
    assert engine.config.fidelity == "fast"
