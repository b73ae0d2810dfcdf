"""Property-based fuzzing (hypothesis) of the constructors that load a model:
``KVBoost.from_pretrained``, LangChain ``ChatKVBoost`` / ``KVBoostPipeline.from_model_id`` and
LlamaIndex ``KVBoostLLM.from_model_id``. For any model name, dtype, device, config and
extra keyword arguments, a call either returns an engine that is what was asked (its
dtype, on the CPU, its config) or raises a ``ValueError`` / ``TypeError`` from the
package's own code (``UnknownModelError`` included), never an error from inside torch or
transformers; an argument that is wrong is refused before the weights load. The adapters'
own fields are validated by pydantic, LangChain's convention: a ``ValidationError`` is
clear when it wraps no error from outside the package. The model is the tiny random Llama
saved as a folder (loads in ~0.1 s). Examples per property: 40 always; 2,000 under the
``slow`` marker (HYPOTHESIS_PROFILE=thorough)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import raised_in_package, run_thorough
from fuzzing import JUNK, attempt, deadline
from hypothesis import event, given
from hypothesis import strategies as st
from pydantic import ValidationError

import kvboost_rag.core.model.stored_weights as loading_module
from kvboost_rag import KVBoost, KVBoostConfig

SOME_JUNK = JUNK.filter(lambda value: value is not None)  # None means "the default" here
# Each argument: (values that load, values that must be refused).
MODELS = (
    st.just("<tiny>"),
    st.sampled_from(
        ["", " ", "/no/such/model", "./missing", "~/missing", "smollm9", "a/b/c", "/", "<file>"]
    )
    | SOME_JUNK,
)
DTYPES = (
    st.sampled_from([None, "float32", "bfloat16", torch.float32, torch.bfloat16, "torch.float32"]),
    st.sampled_from(["fp32", "bf16", "int8", "uint8", "float8_e4m3fn", "float64x", "", torch.int8])
    | SOME_JUNK,
)
DEVICES = (
    st.sampled_from([None, "cpu", "cpu:0", torch.device("cpu")]),
    st.sampled_from(["gpu", "", "cuda:99", "meta", "xla", "cpu:x", "mps"])
    | (st.just("cuda") if not torch.cuda.is_available() else st.nothing())
    | st.sampled_from([0, 1.5, b"cpu"]),
)
CONFIGS = (
    st.sampled_from([None, KVBoostConfig(), KVBoostConfig(fidelity="fast")]),
    st.sampled_from([{"fidelity": "fast"}, "balanced", 3]),
)
MODEL_KWARGS = (
    st.sampled_from([{}, {"attn_implementation": "eager"}, {"low_cpu_mem_usage": True}]),
    st.sampled_from(
        [
            {"fidelity": "fast"},
            {"cache_dir": "/tmp/kv"},
            {"max_batch_size": 2},
            {"torch_dtype": torch.float32},
            {"colour": "red"},
            {"max_new_tokens": 5},
        ]
    ),
)
ARGUMENTS = {"model": MODELS, "dtype": DTYPES, "device": DEVICES, "config": CONFIGS}


@st.composite
def calls(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """``(arguments, model_kwargs, wrong)``: a third of the time one value (the argument
    ``wrong`` names) must be refused."""
    wrong = draw(st.sampled_from([None, None, *ARGUMENTS, "model_kwargs"]))
    chosen = {name: draw(bad if name == wrong else good) for name, (good, bad) in ARGUMENTS.items()}
    kwargs = draw(MODEL_KWARGS[1] if wrong == "model_kwargs" else MODEL_KWARGS[0])
    return chosen, kwargs, wrong


@pytest.fixture(scope="module")
def folder(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    a_file = tmp_path_factory.mktemp("loading") / "notes.txt"
    a_file.write_text("not a model")
    return {"<tiny>": tiny_model_dir, "<file>": str(a_file)}


@pytest.fixture(scope="module")
def loads() -> list[str]:
    """Models whose weights were loaded: a refused call loads none."""
    loaded: list[str] = []
    real = loading_module.load_model

    def counted(path: str, *args: Any, **kwargs: Any) -> Any:
        loaded.append(path)
        return real(path, *args, **kwargs)

    loading_module.load_model = counted  # type: ignore[assignment]
    yield loaded
    loading_module.load_model = real  # type: ignore[assignment]


def resolved(arguments: dict[str, Any], folder: dict[str, str]) -> dict[str, Any]:
    model = arguments["model"]
    return {**arguments, "model": folder.get(model, model) if isinstance(model, str) else model}


def check_engine(engine: KVBoost, arguments: dict[str, Any]) -> None:
    assert isinstance(engine, KVBoost) and engine.model.device.type == "cpu"
    dtype = arguments["dtype"]
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        assert engine.model.dtype == getattr(torch, name)
    config = arguments["config"]
    assert engine.config == (config or KVBoostConfig())


@given(call=calls())
def test_from_pretrained_loads_what_was_asked_or_refuses_before_loading(folder, loads, call):
    arguments, kwargs, wrong = call
    arguments = resolved(arguments, folder)
    before = len(loads)
    engine = attempt(lambda: KVBoost.from_pretrained(**arguments, **kwargs))
    assert engine is None or wrong is None, f"accepted {arguments} {kwargs}"
    if engine is not None:
        check_engine(engine, arguments)
    elif not set(kwargs) & TRANSFORMERS_REFUSES:
        assert len(loads) == before, f"loaded before refusing {arguments} {kwargs}"


# Model kwargs only transformers can tell it does not take (it passes unknown ones on to
# the model's config and constructor): refused clearly, once the weights are read.
TRANSFORMERS_REFUSES = {"colour", "max_new_tokens"}


def clear(error: BaseException) -> bool:
    """A pydantic ``ValidationError`` on the adapter's own fields, or the package's error."""
    if isinstance(error, ValidationError):
        return all(
            not isinstance((e.get("ctx") or {}).get("error"), Exception)
            or raised_in_package((e.get("ctx") or {})["error"])
            for e in error.errors()
        )
    return isinstance(error, (ValueError, TypeError)) and raised_in_package(error)


ADAPTER_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.sampled_from([1, 8, 0, True, "8"]),
        "temperature": st.sampled_from([0.0, 0.7, -1.0, float("nan")]),
        "streaming": st.booleans(),
        "colour": st.just("red"),
    },
)


def bad_fields(fields: dict[str, Any]) -> bool:
    temperature = fields.get("temperature", 0.0)
    return (
        fields.get("max_tokens") in (0, "8")
        or fields.get("max_tokens") is True
        or "colour" in fields
        or not temperature >= 0  # -1 and NaN
    )


@given(
    call=calls(),
    fields=ADAPTER_FIELDS,
    adapter=st.sampled_from(["ChatKVBoost", "KVBoostPipeline", "llamaindex"]),
)
def test_from_model_id_builds_or_refuses_clearly(folder, loads, call, fields, adapter) -> None:
    arguments, kwargs, wrong = call
    arguments = resolved(arguments, folder)
    model, expected = arguments.pop("model"), arguments["config"]
    if adapter == "llamaindex":
        from kvboost_rag.integrations.llamaindex import KVBoostLLM as li_llm

        build = lambda: li_llm.from_model_id(model, model_kwargs=kwargs, **arguments, **fields)  # noqa: E731
    else:
        from kvboost_rag.integrations import langchain

        cls = getattr(langchain, adapter)
        build = lambda: cls.from_model_id(model, **arguments, **fields)  # noqa: E731
        wrong = None if wrong == "model_kwargs" else wrong  # LangChain's take none: not passed
        if isinstance(arguments["config"], dict):  # pydantic builds a dataclass from a dict
            wrong, expected = None, KVBoostConfig(**arguments["config"])
    with deadline():
        try:
            built = build()
        except Exception as error:  # the property inspects every error
            assert clear(error), f"{type(error).__name__}: {error}"
            event(f"refused: {type(error).__name__}")
            return
    event("built")
    assert wrong is None and not bad_fields(fields), f"accepted {arguments} {kwargs} {fields}"
    check_engine(built.engine, {**arguments, "config": expected})


@pytest.mark.slow
def test_every_property_holds_over_2000_examples() -> None:
    run_thorough(__file__, 2)
