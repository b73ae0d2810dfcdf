"""What a loaded model's linear layers are stored as: ``from_pretrained(weights=...)``."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from pathlib import Path
from typing import Any

from kvboost_rag.core.model import lean_layers
from kvboost_rag.core.model.blocks import use_blocks
from kvboost_rag.core.model.quantized import quantize
from kvboost_rag.core.model.sibling_blocks import join


def store_weights(
    model: Any, kind: str | None, folder: str | Path, gguf: Any, cache_root: Path
) -> None:
    """``model``'s linear layers stored as ``kind`` (``quantized.weights_for``'s answer):
    a GGUF's blocks (``use_blocks``), siblings that read one input joined (``join``), the
    decoder layers' small operators on our kernel too (``lean_layers``); quantized from
    float; or left as they are (None)."""
    if kind == "gguf":
        assert gguf is not None
        use_blocks(model, Path(folder), gguf, cache_root)
        join(model)
        lean_layers.install(model)
    elif kind is not None:
        quantize(model, kind)
    release_freed_memory()


def release_freed_memory() -> None:
    """Give what loading freed (float weights replaced, fp32 copies cast) back to the
    system: glibc keeps freed heap mapped, so a 0.5B on its blocks stayed ~0.7 GB larger
    than what it holds. A no-op off glibc."""
    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
