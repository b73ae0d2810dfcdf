"""What a loaded model's linear layers are stored as: ``from_pretrained(weights=...)``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.core.model import lean_layers
from kvboost_rag.core.model.blocks import BlockLinear
from kvboost_rag.core.model.converted import load_tensors
from kvboost_rag.core.model.gguf import source_formats
from kvboost_rag.core.model.gguf_layers import cached_names, use_blocks
from kvboost_rag.core.model.heap import release_freed_memory
from kvboost_rag.core.model.loading import load_model
from kvboost_rag.core.model.quantized import quantize, weights_for
from kvboost_rag.core.model.sibling_blocks import join


def kind_of(
    weights: str | None,
    path: str,
    gguf: Callable[[], Path] | None,
    device: torch.device,
    dtype: torch.dtype,
    model_kwargs: Mapping[str, Any],
) -> str | None:
    """What the linear layers of the model at ``path`` (converted from the GGUF ``gguf()``;
    None: another folder) are stored as, for ``weights`` as ``check_weights`` took it
    (``weights_for``, told the GGUF's formats)."""
    formats = None if gguf is None else partial(source_formats, Path(path), gguf)
    return weights_for(weights, formats, device, dtype, model_kwargs)


def load_stored(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    kind: str | None,
    gguf: Any,
    cache_root: Path,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """The model and tokenizer at ``path`` with their linear layers stored as ``kind``
    (``store_weights``). A folder converted from the GGUF ``gguf()`` (None: another folder)
    is read tensor by tensor, and on its blocks without the float weights they replace:
    those the cache names or, before there is a cache, every linear layer's (each layer
    the GGUF holds in no block format is then read)."""
    unread: set[str] = set()

    def skip(model: Any) -> set[str]:
        if kind == "gguf":
            unread.update(cached_names(Path(path)) or _linear_weights(model))
        return unread

    model, tokenizer = load_model(
        path, dtype, device, skip=None if gguf is None else skip, **model_kwargs
    )
    store_weights(model, kind, path, gguf, cache_root, frozenset(unread))
    return model, tokenizer


def _linear_weights(model: Any) -> set[str]:
    return {f"{n}.weight" for n, m in model.named_modules() if type(m) is torch.nn.Linear}


def store_weights(
    model: Any,
    kind: str | None,
    folder: str | Path,
    gguf: Any,
    cache_root: Path,
    unread: frozenset[str] = frozenset(),
) -> None:
    """``model``'s linear layers stored as ``kind`` (``quantized.weights_for``'s answer):
    a GGUF's blocks (``use_blocks``), siblings that read one input joined (``join``), the
    decoder layers' small operators on our kernel too (``lean_layers``); quantized from
    float; or left as they are (None). ``unread``: weights the load left unread (blocks
    are checked against the folder's rows then), read now where no block replaced them."""
    if kind == "gguf":
        assert gguf is not None
        use_blocks(model, Path(folder), gguf, cache_root, unread)
        blocks = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, BlockLinear)}
        load_tensors(Path(folder), model, unread - blocks)
        join(model)
        lean_layers.install(model)
    elif kind is not None:
        quantize(model, kind)
    release_freed_memory()
