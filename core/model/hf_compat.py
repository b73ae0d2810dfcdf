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
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import get_layer_types_and_kwargs

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


def gguf_tensors(path: str, model: Any) -> Iterator[tuple[str, Any]]:
    """The tensors of the GGUF file ``path`` one at a time, dequantized to float32 numpy
    arrays under ``model``'s state-dict names (``model`` may sit on the meta device), each
    as transformers' GGUF loader makes it (its per-architecture processors: Llama's q/k
    rows put back in order, norms shifted, experts split). The loader itself keeps every
    tensor until the last is read (a 7B's 28 GB); this yields them as it goes."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    parsed = load_gguf_checkpoint(path, return_tensors=False)
    reader = GGUFReader(path)
    architecture = str(reader.fields["general.architecture"].contents())
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    mapping = get_gguf_hf_weights_map(model, processor)
    parsed["tensors"] = {}
    for tensor in reader.tensors:
        weights = _dequantized(tensor, dequantize)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=mapping, parsed_parameters=parsed
        )
        yield from parsed["tensors"].items()  # what a processor placed itself (experts)
        parsed["tensors"].clear()
        if result.weights is not None and result.name in mapping:
            yield mapping[result.name], result.weights


DEQUANTIZED_BYTES = 64 * 2**20  # float32 bytes dequantized at once: gguf-py's temporaries


def _dequantized(tensor: Any, dequantize: Callable[..., Any]) -> Any:
    """``tensor``'s float32 values, dequantized a slice of its leading axis at a time: gguf-py
    makes several temporaries the size of what it dequantizes, which for a 1.5B's embedding
    table (933 MB in float32) came to gigabytes."""
    import numpy as np

    data, kind = tensor.data, tensor.tensor_type
    if data.ndim < 2 or data.shape[0] < 2:
        return dequantize(data, kind)
    first = dequantize(data[:1], kind)
    step = max(1, DEQUANTIZED_BYTES // max(1, first.nbytes))
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    for start in range(0, data.shape[0], step):
        out[start : start + step] = dequantize(data[start : start + step], kind)
    return out
