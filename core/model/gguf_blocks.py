"""A GGUF tensor's quantized blocks read as they are: per output row, unsigned levels ``q``
and, per group of 16 or 32 inputs, a scale and a minimum, W = scale * (q - zero) + min.

Every block format the embedded models ship decodes to that form with no second rounding
of its levels: Q4_0 / Q4_1 / Q4_K (4-bit levels, groups of 32), Q6_K (6 bits, groups of
16), Q5_0 / Q5_1 / Q5_K and Q8_0 (5 or 8 bits, kept in a byte). Q4_K and Q6_K keep their
scales as the file holds them (``Levels.units``: an fp16 unit per 256 inputs times an
integer multiplier per group, for the scales and Q4_K's minimums), which the kernel
multiplies in integers. The other formats' scales are kept in fp16: the legacy formats' own
(exact); Q5_K's two-level scales (up to 19 significant bits) rounded to fp16's 11, half an
fp16 ulp of each scale. The decoders follow ggml's block layouts (``ggml-quants.c``);
``tests/model/test_gguf_blocks.py`` checks each against gguf-py's dequantization.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Levels(NamedTuple):
    q: np.ndarray  # uint8 [rows, inputs], unsigned levels
    scale: np.ndarray  # float16 [rows, inputs / group] (uint8 multipliers with ``units``)
    mins: np.ndarray | None  # float16 like scale; None: symmetric (min = 0)
    zero: int  # subtracted from every level (symmetric formats)
    bits: int  # 4: levels fit a nibble; 6: Q6_K's, kept in 6 bits; 8: a byte
    group: int  # inputs per scale
    # K formats' two-level scales as the file holds them: float16 [rows, inputs / 256, 2 or
    # 1], the unit d (and the minimums' unit dmin) of each 256 inputs; then ``scale`` (and
    # ``mins``) are their integer multipliers and W = d * sc * (q - zero) - dmin * m
    units: np.ndarray | None = None

    def scales(self) -> tuple[np.ndarray, np.ndarray | None]:
        """float32 [rows, inputs / group]: each group's scale and minimum (None: symmetric)."""
        if self.units is None:
            mins = None if self.mins is None else self.mins.astype(np.float32)
            return self.scale.astype(np.float32), mins
        per = self.units.shape[1]
        unit = np.repeat(self.units.astype(np.float32), self.scale.shape[1] // per, axis=1)
        mins = None if self.mins is None else -unit[..., 1] * self.mins
        return unit[..., 0] * self.scale, mins

    def rows(self, index: np.ndarray) -> Levels:
        """The levels of rows ``index`` only."""
        take = lambda a: None if a is None else a[index]  # noqa: E731
        return self._replace(
            q=self.q[index], scale=self.scale[index], mins=take(self.mins), units=take(self.units)
        )


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's legacy order: a block's bytes' low nibbles are its first half, high its second."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit i of the block's 32-bit qh is level i's fifth bit."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")  # [blocks, 32], bit i of qh
    return (bits << 4).astype(np.uint8)


def _legacy(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d = _f16(blocks, 0)
    if kind == "Q4_0":
        return _nibbles(blocks[:, 2:18]), d, None
    if kind == "Q4_1":
        return _nibbles(blocks[:, 4:20]), d, _f16(blocks, 2)
    if kind == "Q5_0":
        return _nibbles(blocks[:, 6:22]) | _high_bits(blocks[:, 2:6]), d, None
    if kind == "Q5_1":
        return _nibbles(blocks[:, 8:24]) | _high_bits(blocks[:, 4:8]), d, _f16(blocks, 2)
    assert kind == "Q8_0"
    return (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, None


LEGACY = {  # format: (bytes a block, zero, bits)
    "Q4_0": (18, 8, 4),
    "Q4_1": (20, 0, 4),
    "Q5_0": (22, 16, 8),
    "Q5_1": (24, 0, 8),
    "Q8_0": (34, 128, 8),
}


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins from 12 bytes."""
    low, high, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([low & 63, (mixed & 0x0F) | ((low >> 6) << 4)], axis=1)
    m = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def _k4_levels(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: each 32 bytes hold two sub-blocks, low nibbles first."""
    chunks = qs.reshape(-1, 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 256)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    sc, m = _k_scales(blocks[:, 4:16])
    units = blocks[:, 0:4].copy().view(np.float16)  # d, dmin
    return _k4_levels(blocks[:, 16:144]), sc.astype(np.uint8), m.astype(np.uint8), units


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sc, m = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48]  # bit j of byte l: sub-block j's level l's fifth bit
    fifth = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = _k4_levels(blocks[:, 48:176]) | (fifth.reshape(-1, 256) << 4).astype(np.uint8)
    return q, _f16(blocks, 0)[:, None] * sc, -_f16(blocks, 2)[:, None] * m


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ql, qh = blocks[:, 0:128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    low = np.concatenate(
        [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], -1
    )
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1)
    units = blocks[:, 208:210].copy().view(np.float16)  # d
    return (low | (high << 4)).reshape(-1, 256), sc.astype(np.int8), units


K_FORMATS = {"Q4_K": (144, 4), "Q5_K": (176, 8), "Q6_K": (210, 6)}
FORMATS = (*LEGACY, *K_FORMATS)


def levels(data: np.ndarray, kind: str, inputs: int) -> Levels:
    """The levels of a tensor of ``inputs`` columns whose rows are ggml blocks of format
    ``kind`` (``data``: uint8 [rows, bytes a row], as gguf-py's reader gives them)."""
    if kind not in FORMATS:
        raise ValueError(f"GGUF format {kind} has no block kernel; formats: {FORMATS}")
    rows = data.shape[0]
    if kind in LEGACY:
        size, zero, bits = LEGACY[kind]
        q, d, m = _legacy(data.reshape(-1, size), kind)
        return Levels(
            q.reshape(rows, inputs),
            d.reshape(rows, -1).astype(np.float16),
            None if m is None else m.reshape(rows, -1).astype(np.float16),
            zero,
            bits,
            32,
        )
    size, bits = K_FORMATS[kind]
    blocks = data.reshape(-1, size)
    if kind == "Q6_K":
        q, sc, units = _q6_k(blocks)
        return Levels(
            q.reshape(rows, inputs), sc.reshape(rows, -1), None, 32, 6, 16,
            units.reshape(rows, -1, 1),
        )  # fmt: skip
    if kind == "Q4_K":
        q, sc, m, units = _q4_k(blocks)
        return Levels(
            q.reshape(rows, inputs), sc.reshape(rows, -1), m.reshape(rows, -1), 0, 4, 32,
            units.reshape(rows, -1, 2),
        )  # fmt: skip
    q, scale, mins = _q5_k(blocks)
    return Levels(
        q.reshape(rows, inputs),
        scale.reshape(rows, -1).astype(np.float16),
        mins.reshape(rows, -1).astype(np.float16),
        0,
        bits,
        32,
    )


def dequantized(lv: Levels) -> np.ndarray:
    """float32 [rows, inputs]: what the levels stand for."""
    scale, mins = lv.scales()
    w = np.repeat(scale, lv.group, axis=1) * (lv.q.astype(np.float32) - lv.zero)
    if mins is not None:
        w += np.repeat(mins, lv.group, axis=1)
    return w
