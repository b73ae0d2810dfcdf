"""Every private transformers call the engine makes, in one place, behind a tested range.

transformers has no public builder for what ``generate`` prepares before its loop (the
logits processors and stopping criteria it derives from a ``GenerationConfig``), and its
attention registry is public but young (torch's private ops have a module of their own,
``torch_compat``). The engine decodes in its own loop and must pick tokens exactly as
``generate`` would, so it calls the same private methods ``generate`` calls. They are used
here only; ``TESTED`` is the range the test suite runs against, and ``pyproject.toml`` pins
the dependency to it (``tests/model/test_hf_compat.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import get_layer_types_and_kwargs

from kvboost_rag.core.model.heap import release_freed_memory

# transformers releases whose private generate helpers this module was tested with:
# [low, high). Keep in step with the pin in pyproject.toml.
TESTED = (Version("5.24"), Version("5.25"))


def version_supported(version: str = transformers.__version__) -> bool:
    low, high = TESTED
    return low <= Version(Version(version).base_version) < high


def logits_processors(
    model: Any, config: GenerationConfig, prompt_tokens: int, extra: LogitsProcessorList
) -> LogitsProcessorList:
    """The logits processors ``generate`` builds from ``config`` (prepared in place: pass a
    copy) for a prompt of ``prompt_tokens`` tokens, ``extra`` merged in, in its order."""
    model._prepare_special_tokens(config, True, device=model.device)
    return model._get_logits_processor(  # type: ignore[no-any-return]
        generation_config=config,
        input_ids_seq_length=prompt_tokens,
        encoder_input_ids=torch.zeros((1, prompt_tokens), dtype=torch.long),
        logits_processor=extra,
        device=model.device,
        model_kwargs={},
    )


def stopping_criteria(
    model: Any, config: GenerationConfig, tokenizer: Any, extra: StoppingCriteriaList
) -> StoppingCriteriaList:
    """The stopping criteria ``generate`` builds from ``config`` (max length, EOS, stop
    strings), ``extra`` merged in. Call after ``logits_processors`` prepared ``config``."""
    return model._get_stopping_criteria(  # type: ignore[no-any-return]
        generation_config=config, stopping_criteria=extra, tokenizer=tokenizer
    )


def layer_types(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """Per decoder layer, transformers' cache layer type and its keyword arguments
    (``sliding_window`` for sliding layers), as ``DynamicCache`` reads them."""
    return get_layer_types_and_kwargs(config)  # type: ignore[no-any-return]


def attention_implementation(model: Any) -> str:
    """The attention implementation the model's layers run (``"sdpa"``, ``"eager"``, ...)."""
    return str(model.config._attn_implementation)


@contextmanager
def eager_attention(model: Any) -> Iterator[None]:
    """Run the model's attention eagerly inside (the only implementation that returns
    attention weights), then restore what it ran."""
    previous = attention_implementation(model)
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def attention_implementations() -> list[str]:
    """The ``attn_implementation=`` names transformers' ``from_pretrained`` takes here:
    "eager" and every registered attention (sdpa, flash and flex ones, any added through
    ``AttentionInterface.register``), as its own check lists them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]


def is_hub_kernel(name: str) -> bool:
    """Whether ``name`` reads as a hub kernel (``org/repo[@rev][:fn]``), which transformers
    fetches at load time."""
    from transformers.integrations.hub_kernels import is_kernel

    return bool(is_kernel(name))


def empty_model(config: Any, dtype: torch.dtype) -> Any:
    """``config``'s causal LM built with its weights allocated and not initialized (no page
    of them touched until loaded), buffers computed (RoPE's frequencies), weights tied as
    ``from_pretrained`` ties them."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


class Streamed(NamedTuple):
    """A tensor too large to hold whole in float32 that transformers' processing passes as
    it is: ``shape``, and ``slices()`` dequantizing a slice of its rows at a time."""

    shape: tuple[int, ...]
    slices: Callable[[], Iterator[Any]]


def gguf_tensors(path: str, model: Any) -> Iterator[tuple[str, Any]]:
    """The tensors of the GGUF file ``path`` one at a time, dequantized to float32 numpy
    arrays under ``model``'s state-dict names (``model`` may sit on the meta device), each
    as transformers' GGUF loader makes it (its per-architecture processors: Llama's q/k
    rows put back in order, norms shifted, experts split). The loader itself keeps every
    tensor until the last is read (a 7B's 28 GB); this yields them as it goes, and a tensor
    over ``STREAM_ABOVE_BYTES`` that the processor leaves as it is (an embedding table: 933 MB
    in float32 at Qwen2.5-Coder-1.5B) as a ``Streamed`` one."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    parsed = load_gguf_checkpoint(path, return_tensors=False)
    for unused in ("tokenizer", "tokenizer_config"):  # a vocabulary's strings: not needed here
        parsed.pop(unused, None)
    reader = GGUFReader(path)
    architecture = str(reader.fields["general.architecture"].contents())
    tensors = list(reader.tensors)
    del reader  # its fields (the vocabulary again, as arrays) take hundreds of MB
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    mapping = get_gguf_hf_weights_map(model, processor)
    parsed["tensors"] = {}

    def process(weights: Any, name: str) -> Any:
        return processor.process(
            weights=weights, name=name, tensor_key_mapping=mapping, parsed_parameters=parsed
        )

    for tensor in tensors:
        streamed = tensor.name in mapping and _streamed(tensor, process, parsed, dequantize)
        if streamed:
            yield mapping[tensor.name], streamed
            continue
        weights = _dequantized(tensor, dequantize)
        result = process(weights, tensor.name)
        yield from parsed["tensors"].items()  # what a processor placed itself (experts)
        parsed["tensors"].clear()
        if result.weights is not None and result.name in mapping:
            yield mapping[result.name], result.weights


DEQUANTIZED_BYTES = 16 * 2**20  # float32 bytes dequantized at once: gguf-py's temporaries
STREAM_ABOVE_BYTES = 4 * DEQUANTIZED_BYTES  # a larger tensor is streamed where it can be


def _streamed(
    tensor: Any, process: Callable[[Any, str], Any], parsed: dict[str, Any], dequantize: Any
) -> Streamed | None:
    """``tensor`` as a ``Streamed`` one where it is over ``STREAM_ABOVE_BYTES`` and ``process``
    gives it back as it is under its own name (tried on its first rows: the same array, the
    same values, nothing placed apart); else None."""
    data = tensor.data
    if data.ndim < 2 or data.shape[0] < 2 or int(tensor.n_elements) * 4 <= STREAM_ABOVE_BYTES:
        return None
    probe = dequantize(data[:2], tensor.tensor_type)
    before = probe.copy()
    result = process(probe, tensor.name)
    apart = bool(parsed["tensors"])
    parsed["tensors"].clear()
    same = result.weights is probe and bool((probe == before).all())
    if not same or result.name != tensor.name or apart:
        return None
    shape = (int(data.shape[0]), *map(int, probe.shape[1:]))
    return Streamed(shape, lambda: _slices(tensor, dequantize))


def _dequantized(tensor: Any, dequantize: Callable[..., Any]) -> Any:
    """``tensor``'s float32 values, dequantized a slice of its leading axis at a time: gguf-py
    makes several temporaries the size of what it dequantizes, which for a 1.5B's embedding
    table (933 MB in float32) came to gigabytes."""
    import numpy as np

    data, kind = tensor.data, tensor.tensor_type
    if data.ndim < 2 or data.shape[0] < 2:
        return dequantize(data, kind)
    out = None
    start = 0
    for part in _slices(tensor, dequantize):
        if out is None:
            out = np.empty((data.shape[0], *part.shape[1:]), dtype=np.float32)
        out[start : start + len(part)] = part
        start += len(part)
    return out


def _slices(tensor: Any, dequantize: Callable[..., Any]) -> Iterator[Any]:
    """``tensor``'s rows dequantized to float32, ``DEQUANTIZED_BYTES`` at a time, what
    each slice's temporaries took given back as it goes."""
    data, kind = tensor.data, tensor.tensor_type
    first = dequantize(data[:1], kind)
    step = max(1, DEQUANTIZED_BYTES // max(1, first.nbytes))
    for start in range(0, data.shape[0], step):
        yield dequantize(data[start : start + step], kind)
        release_freed_memory(collect=False)
