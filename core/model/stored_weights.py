"""What a loaded model's linear layers are stored as: ``from_pretrained(weights=...)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvboost_rag.core.model.blocks import use_blocks
from kvboost_rag.core.model.quantized import quantize
from kvboost_rag.core.model.sibling_blocks import join


def store_weights(
    model: Any, kind: str | None, folder: str | Path, gguf: Any, cache_root: Path
) -> None:
    """``model``'s linear layers stored as ``kind`` (``quantized.weights_for``'s answer):
    a GGUF's blocks (``use_blocks``), siblings that read one input joined (``join``);
    quantized from float; or left as they are (None)."""
    if kind == "gguf":
        assert gguf is not None
        use_blocks(model, Path(folder), gguf, cache_root)
        join(model)
    elif kind is not None:
        quantize(model, kind)
