"""A GGUF file's header read without its values: its architecture and, per tensor, its
format, shape and where its bytes are.

gguf-py's ``GGUFReader`` parses every metadata value into numpy views (a 150k-token
vocabulary and its merges: 5-8 s and hundreds of MB on Qwen2.5-Coder-1.5B); this walks the
same layout (``gguf.md`` of ggml: magic, version, counts, key-value pairs, tensor infos,
aligned data) and skips the values it does not need, reading a string array's lengths only.
``tests/model/test_gguf_header.py`` checks it against ``GGUFReader`` on every embedded file.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import NamedTuple

# a scalar value's size by its GGUF type id (4 uint32, 6 float32, 7 bool, 10 uint64, ...)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# the numpy dtype of a format of one element a block, as gguf-py reads it (bf16 as its bits)
_ELEMENTS = {"F32": "float32", "F16": "float16", "BF16": "uint16", "F64": "float64"}
_ELEMENTS |= {f"I{bits}": f"int{bits}" for bits in (8, 16, 32, 64)}
_ALIGNMENT = 32  # the data section's, unless ``general.alignment`` says otherwise


class Tensor(NamedTuple):
    """A tensor of the file: its format (gguf-py's type name: "Q4_K", "F32", ...), its shape
    as numpy orders it (outputs first; for a block format, bytes a row last, as gguf-py's
    reader gives ``data``), its numpy dtype and the absolute offset of its bytes."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    offset: int


class Header(NamedTuple):
    architecture: str
    tensors: dict[str, Tensor]


def read_header(path: str | Path) -> Header:
    """``path``'s architecture and tensors; ``ValueError`` for a file that is not a GGUF (v2
    or v3) or ends inside its header."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            return _parse(m)
        except struct.error as e:
            raise ValueError(f"{path}: the GGUF header ends early ({e})") from None


def _parse(m: mmap.mmap) -> Header:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if m[:4] != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    version, count, pairs = struct.unpack_from("<IQQ", m, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not read here (2 and 3 are)")
    at = 24
    architecture, alignment = "", _ALIGNMENT

    def text(at: int) -> tuple[str, int]:
        (size,) = struct.unpack_from("<Q", m, at)
        return m[at + 8 : at + 8 + size].decode("utf-8"), at + 8 + size

    for _ in range(pairs):
        key, at = text(at)
        (kind,) = struct.unpack_from("<I", m, at)
        at += 4
        if key == "general.architecture" and kind == _STRING:
            architecture, at = text(at)
        elif key == "general.alignment" and kind == _UINT32:
            (alignment,) = struct.unpack_from("<I", m, at)
            at += 4
        else:
            at = _skipped(m, at, kind)
    tensors: dict[str, tuple[int, tuple[int, ...], int]] = {}
    for _ in range(count):
        name, at = text(at)
        (dims,) = struct.unpack_from("<I", m, at)
        ne = struct.unpack_from(f"<{dims}Q", m, at + 4)
        kind, offset = struct.unpack_from("<IQ", m, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        tensors[name] = (kind, ne, offset)
    start = -(-at // alignment) * alignment
    out = {}
    for name, (kind, ne, offset) in tensors.items():
        quant = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[quant]
        rows = tuple(reversed(ne[1:]))
        if block == 1:  # a float or integer tensor: its elements as they are
            shape, dtype = (*rows, ne[0]), _ELEMENTS[quant.name]
        else:  # blocks: bytes a row
            shape, dtype = (*rows, ne[0] // block * size), "uint8"
        out[name] = Tensor(quant.name, shape, dtype, start + offset)
    return Header(architecture, out)


def _skipped(m: mmap.mmap, at: int, kind: int) -> int:
    """Where a value of GGUF type ``kind`` starting at ``at`` ends."""
    if kind in _SIZES:
        return at + _SIZES[kind]
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", m, at)[0]
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    element, count = struct.unpack_from("<IQ", m, at)
    at += 12
    if element in _SIZES:
        return at + _SIZES[element] * count
    for _ in range(count):
        at = _skipped(m, at, element)
    return at


def formats(tensors: dict[str, Tensor]) -> dict[str, int]:
    """Each format's share of the file's weights: parameters per format name."""
    counts: dict[str, int] = {}
    for t in tensors.values():
        counts[t.kind] = counts.get(t.kind, 0) + math.prod(t.shape[:-1]) * _columns(t)
    return counts


def _columns(t: Tensor) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t.kind]]
    return t.shape[-1] if block == 1 else t.shape[-1] // size * block  # elements or bytes
