"""A model's linear layers put on a GGUF file's own blocks (``blocks.BlockLinear``), and
the packed blocks cached beside the converted checkpoint.

The first start reads each linear layer's tensor from the GGUF (``gguf_blocks.levels``),
one mapped tensor at a time, checks sampled rows against the loaded weight, or the folder's
where the weight was left unread, packs it, joins siblings that read one input
(``SIBLINGS``) and writes the cache (``blocks-<kernel version>-joined.safetensors``); then
it maps that file as every later start does: no GGUF read, no float weight read, no copy.
What the first start holds at its peak is the model without its linear weights, their
packed blocks and one tensor's temporaries.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvboost_rag.core.model import block_kernel
from kvboost_rag.core.model.blocks import (
    PARTS,
    BlockLinear,
    measure,
    pack,
    packed_format,
    supports,
)
from kvboost_rag.core.model.converted import read_rows
from kvboost_rag.core.model.gguf_blocks import FORMATS, Levels, dequantized, levels
from kvboost_rag.core.model.gguf_header import read_header
from kvboost_rag.core.model.heap import release_freed_memory
from kvboost_rag.core.model.linears import SIBLINGS

log = logging.getLogger(__name__)


def cache_file(folder: Path) -> Path:
    """Where a converted checkpoint's packed blocks are kept, named by the kernel's version."""
    return folder / f"blocks-{block_kernel.version()}-joined.safetensors"


def cached_names(folder: Path) -> set[str]:
    """The weights (state-dict names) whose blocks ``folder``'s cache holds: a start reads
    them from there, not from the folder (empty when nothing is cached)."""
    from safetensors import safe_open

    cached = cache_file(folder)
    if not cached.exists():
        return set()
    with safe_open(str(cached), framework="pt") as f:
        keys = {key.rpartition("|")[0] for key in f.keys()}
    return {f"{name}.weight" for key in keys for name in key.split(",")}


def use_blocks(
    model: Any, folder: Path, gguf: Any, cache_root: Path, unread: frozenset[str] = frozenset()
) -> list[BlockLinear]:
    """Replace ``model``'s linear layers whose GGUF tensors are in a block format with
    ``BlockLinear``s (the others stay as they are), from ``folder``'s cache of packed blocks
    (mapped, not copied; siblings as views of their joint tensors) or, the first time, from
    the GGUF file ``gguf()`` returns (then cached, and mapped from there); the new
    layers. A tensor whose levels do not give the loaded weight back (a layout this reader
    does not know; the folder's rows for a weight ``unread``) is left dense, with a
    warning."""
    from safetensors.torch import load_file

    cached = cache_file(folder)
    packed = None
    if not cached.exists():

        def unread_in(name: str) -> Path | None:
            return folder if name in unread else None

        packed = _joined(model, _from_gguf(model, Path(gguf()), unread_in))
        if _saved(packed, cached):
            packed = None  # mapped from there: the first start holds what a later one does
            release_freed_memory()
    if packed is None:
        packed = _split(load_file(cached))
    named = {n: own for key, entry in packed.items() for n, own in _members(key, entry)}
    text, head = model.config.get_text_config(), _head_name(model)
    if text.tie_word_embeddings and head in named:
        text.tie_word_embeddings = False  # the head gets its blocks; the embedding table stays
    layers = []
    for name, (tensors, joint) in named.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        linear = getattr(owner, attr)
        layer = BlockLinear(tensors, linear.bias, cache_root)
        layer.joint = joint
        setattr(owner, attr, layer)
        layers.append(layer)
    decoder = [layer for name, layer in zip(named, layers) if name != head]
    if decoder:
        costs = measure(max(decoder, key=lambda m: m.in_features * m.out_features))
        for layer in layers:
            layer.costs = costs
    return layers


Packed = dict[str, torch.Tensor]


def _members(key: str, entry: Packed) -> list[tuple[str, tuple[Packed, Packed | None]]]:
    """The layers a cache entry holds, each with its packed tensors: one layer's own, or
    each sibling's views of a joint entry (keyed by the siblings' names, with their
    ``sizes``) and that entry."""
    names = key.split(",")
    if len(names) == 1:
        return [(key, (entry, None))]
    info, start = entry["info"].tolist(), 0
    out: list[tuple[str, tuple[Packed, Packed | None]]] = []
    for name, size in zip(names, entry["sizes"].tolist()):
        rows = slice(start // 16, (start + size) // 16)
        own = {p: entry[p][rows] for p in PARTS if p in entry}
        own["info"] = torch.tensor([size, *info[1:]], dtype=torch.int64)
        out.append((name, (own, entry)))
        start += size
    return out


def _head_name(model: Any) -> str:
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is head)


def _from_gguf(
    model: Any, gguf: Path, unread_in: Callable[[str], Path | None]
) -> dict[str, dict[str, torch.Tensor]]:
    """Each linear layer's packed blocks from ``gguf``, checked against the loaded weight
    or, for a weight ``unread_in`` gives a folder for, that folder's rows."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_name, tensors = read_header(gguf)  # not gguf-py's reader: its vocabulary's arrays
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch_name)
    text = model.config.get_text_config()
    names = get_tensor_name_map(arch, text.num_hidden_layers)
    head = _head_name(model)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    linears.sort(key=lambda pair: pair[0] != head)  # its temporaries while little is held
    packed = {}
    for name, linear in linears:
        found = names.get_name(name)
        key = f"{found}.weight" if found else None
        if name == head and key not in tensors:
            key = "token_embd.weight"  # a tied head: the file holds the embedding table only
        tensor = tensors.get(key) if key else None
        if tensor is None or tensor.kind not in FORMATS:
            continue
        data = np.memmap(gguf, tensor.dtype, "r", tensor.offset, tensor.shape)
        lv = levels(data, tensor.kind, linear.in_features)
        del data  # unmapped: the process holds one tensor of the file at a time
        if arch_name == "llama" and found and found.endswith(("attn_q", "attn_k")):
            heads = text.num_attention_heads if found.endswith("q") else text.num_key_value_heads
            lv = _unpermuted(lv, heads)
        rows, inputs = lv.q.shape
        if not supports(rows, inputs, lv) or (rows, inputs) != tuple(linear.weight.shape):
            continue
        if not _matches(lv, _rows_of(linear.weight, f"{name}.weight", unread_in)):
            log.warning(
                "%s: the GGUF's %s levels do not give the loaded weight; left dense", name, key
            )
            continue
        packed[name] = pack(lv)
        del lv
        release_freed_memory(collect=False)  # temporaries between packed tensors
    return packed


def _joined(model: Any, packed: dict[str, Packed]) -> dict[str, Packed]:
    """``packed`` with each module's siblings (``SIBLINGS``) of one format as one entry,
    as the cache holds them: their tensors joined, keyed by their names (``"a,b,c"``) with
    their ``sizes``; each member's tensors freed as they are joined."""
    for prefix, _ in model.named_modules():
        for siblings in SIBLINGS:
            present = [k for k in (f"{prefix}.{n}" for n in siblings) if k in packed]
            by_format: dict[tuple[Any, ...], list[str]] = {}
            for key in present:
                by_format.setdefault(packed_format(packed[key]), []).append(key)
            for group in (g for g in by_format.values() if len(g) > 1):
                members = [packed.pop(key) for key in group]
                sizes = [int(m["info"][0]) for m in members]
                parts = [p for p in PARTS if p in members[0]]
                joint = {p: torch.cat([m.pop(p) for m in members]) for p in parts}
                info = [sum(sizes), *members[0]["info"].tolist()[1:]]
                joint["info"] = torch.tensor(info, dtype=torch.int64)
                joint["sizes"] = torch.tensor(sizes, dtype=torch.int64)
                packed[",".join(group)] = joint
                release_freed_memory(collect=False)  # the members' tensors, freed
    return packed


def _saved(packed: dict[str, Packed], target: Path) -> bool:
    """Whether ``packed`` could be cached at ``target`` (written, every other cache file of
    that folder, an older kernel's, removed); a folder that cannot be written to keeps no
    cache, with a warning, and the blocks stay in memory."""
    if not packed:
        return False
    try:
        save(packed, target)
    except OSError as e:
        log.warning("the packed blocks could not be cached in %s (%s)", target.parent, e)
        return False
    for old in target.parent.glob("blocks-*.safetensors"):
        if old != target:
            old.unlink(missing_ok=True)
    return True


def _unpermuted(lv: Levels, heads: int) -> Levels:
    """llama.cpp stores Llama's q/k rows interleaved per head (its RoPE pairs neighbours);
    the rows in transformers' order (what its GGUF loader undoes)."""
    rows = lv.q.shape[0]
    order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
    # transformers' w.reshape(h, d, 2, ...).swapaxes(2, 1): its row i is the file's order[i]
    return lv.rows(order)


def _rows_of(
    weight: torch.Tensor, name: str, unread_in: Callable[[str], Path | None]
) -> Callable[[np.ndarray], torch.Tensor]:
    """What gives a weight's rows: the folder's for one left unread, else the loaded weight
    (a tied head's is the embedding table's)."""
    folder = unread_in(name)

    def rows_of(rows: np.ndarray) -> torch.Tensor:
        found = None if folder is None else read_rows(folder, name, rows.tolist())
        return found if found is not None else weight.detach()[torch.from_numpy(rows)].float()

    return rows_of


def _matches(lv: Levels, rows_of: Callable[[np.ndarray], Any], samples: int = 8) -> bool:
    """Whether sampled rows of the levels dequantize to the weight's rows ``rows_of`` gives
    (to its dtype's rounding and fp16 scales')."""
    rows = np.linspace(0, lv.q.shape[0] - 1, samples).astype(np.int64)
    ours = torch.from_numpy(dequantized(lv.rows(rows)))
    loaded = rows_of(rows)
    tolerance = 2**-7 * loaded.abs().amax(1, keepdim=True) + 1e-6
    return bool(((ours - loaded).abs() <= tolerance).all())


def save(packed: dict[str, dict[str, torch.Tensor]], target: Path) -> None:
    """``packed`` (layer or sibling names: their tensors) written to ``target`` atomically."""
    from safetensors.torch import save_file

    flat = {f"{name}|{part}": t for name, parts in packed.items() for part, t in parts.items()}
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    save_file(flat, str(tmp))
    os.replace(tmp, target)  # atomic: a concurrent start reads a whole file or none


def _split(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, _, part = key.rpartition("|")
        packed.setdefault(name, {})[part] = t
    return packed
