"""A converted GGUF folder loaded tensor by tensor, without what a start does not need.

``from_pretrained`` of a converted folder (float32 shards, ``gguf.py``) maps every shard and
keeps its pages while it casts, so a 1.5B in bf16 peaked at 10.4 GiB for a 3.3 GiB model,
and a start on the GGUF's blocks loaded 2.8 GiB of float weights only to replace them.
``load_converted`` builds the model with its weights allocated and untouched
(``hf_compat.empty_model``), then copies each tensor the start needs into it, cast to the
model's dtype, a slice of rows at a time, each slice through its own map of the file (so
what the process holds of the folder is one slice, not a shard); the tensors in ``skip``
(weights the caller replaces: a GGUF's blocks) are never read, and their memory never
touched. It loads only folders ``convert_gguf`` wrote, whose tensors are the model's own
state-dict names, every one present; anything else is ``from_pretrained``'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.core.model import hf_compat

SLICE_BYTES = 64 * 2**20  # bytes of the folder read at once


class NotConverted(Exception):
    """The folder is not one ``load_converted`` reads as ``from_pretrained`` would."""


def load_converted(
    folder: Path, dtype: torch.dtype, skip: Callable[[Any], Collection[str]] = lambda m: ()
) -> Any:
    """The causal LM in ``folder`` (a ``convert_gguf`` folder) in ``dtype`` on the CPU, in
    eval mode, with its generation config; the tensors ``skip(model)`` names left unread
    (asked once the folder is known to be the model's: nothing raises after it).
    ``NotConverted`` when the folder's tensors are not exactly the model's."""
    from transformers import AutoConfig, GenerationConfig

    files = _tensor_files(folder)
    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "quantization_config", None) is not None:
        raise NotConverted("a quantized checkpoint")
    model = hf_compat.empty_model(config, dtype)
    if getattr(model, "_keep_in_fp32_modules", None):
        raise NotConverted("modules kept in float32")
    wanted = _loaded_tensors(model)
    given = {name: file for file, names in files.items() for name in names}
    if not set(wanted) <= set(given) or not set(given) <= set(wanted) | _tied(model):
        raise NotConverted("tensors other than the model's")
    for file, names in files.items():
        for name, shape in _shapes(folder / file, names).items():
            if name in wanted and shape != list(wanted[name].shape):
                raise NotConverted(f"{name}'s shape in the folder is not the model's")
    unread = set(skip(model))
    load_tensors(folder, model, [name for name in wanted if name not in unread])
    model.config._name_or_path = str(folder)  # as from_pretrained names it
    if (folder / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


def _tensor_files(folder: Path) -> dict[str, list[str]]:
    """Each weights file of ``folder`` and the tensors it holds."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        raise NotConverted("no sharded safetensors index")
    files: dict[str, list[str]] = {}
    for name, file in json.loads(index.read_text())["weight_map"].items():
        files.setdefault(file, []).append(name)
    return files


def _loaded_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers a checkpoint gives, each once (a tied one under
    its first name)."""
    out = dict(model.named_parameters())
    persistent = model.state_dict(keep_vars=True)
    out |= {n: b for n, b in model.named_buffers() if n in persistent}
    return out


def _tied(model: Any) -> set[str]:
    """State-dict names that alias a tensor listed under another name."""
    return set(model.state_dict(keep_vars=True)) - set(_loaded_tensors(model))


def load_tensors(folder: Path, model: Any, names: Collection[str]) -> None:
    """``names`` (state-dict names the folder holds) copied from ``folder`` into ``model``'s
    tensors, cast to their dtype: small tensors through one map of their file per
    ``SLICE_BYTES`` of them (a map per tensor cost the 0.5B seconds), a larger one a slice
    at a time."""

    tensors, wanted = model.state_dict(keep_vars=True), set(names)
    for file, held in _tensor_files(folder).items():
        batch: list[str] = []
        size = 0
        for name in [n for n in held if n in wanted]:
            nbytes = tensors[name].numel() * 4  # float32 in the folder
            if nbytes > SLICE_BYTES:
                _copy(folder / file, name, tensors[name])
                continue
            if size + nbytes > SLICE_BYTES:
                _copy_all(folder / file, batch, tensors)
                batch, size = [], 0
            batch.append(name)
            size += nbytes
        _copy_all(folder / file, batch, tensors)


def _copy_all(file: Path, names: list[str], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors import safe_open

    if not names:
        return
    with safe_open(str(file), framework="pt") as f, torch.no_grad():
        for name in names:
            tensors[name].copy_(f.get_tensor(name))


def read_rows(folder: Path, name: str, rows: Sequence[int]) -> torch.Tensor | None:
    """Rows ``rows`` of the tensor ``name`` in ``folder``, as float32; None if it is not
    there (a tied head)."""
    from safetensors import safe_open

    file = {n: f for f, names in _tensor_files(folder).items() for n in names}.get(name)
    if file is None:
        return None
    with safe_open(str(folder / file), framework="pt") as f:
        part = f.get_slice(name)
        return torch.cat([part[r : r + 1] for r in rows]).float()


def _shapes(file: Path, names: Collection[str]) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return {name: list(f.get_slice(name).get_shape()) for name in names}


def _copy(file: Path, name: str, target: torch.Tensor) -> None:
    from safetensors import safe_open

    shape = list(target.shape)
    rows = shape[0] if shape else 1
    step = max(1, SLICE_BYTES // max(1, target.numel() // max(1, rows) * 4))
    with torch.no_grad():
        for start in range(0, rows, step):
            with safe_open(str(file), framework="pt") as f:  # one map per slice: see above
                part = f.get_slice(name)
                values = part[start : start + step] if shape else part[:]
            (target[start : start + step] if shape else target).copy_(values)
