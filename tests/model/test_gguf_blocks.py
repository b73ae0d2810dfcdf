"""A GGUF tensor's blocks read as levels (``model/gguf_blocks.py``, issue 60): for every block
format, the levels, scales and mins dequantize to what gguf-py's reference dequantization
gives (exactly for the legacy formats, whose scales are fp16 already; to fp16's rounding of
the K formats' two-level scales: half an fp16 ulp of each term), on random blocks and on
the embedded models' own files."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kvboost_rag.core.model.embedded import embedded_available, gguf_path
from kvboost_rag.core.model.gguf_blocks import FORMATS, LEGACY, dequantized, levels
from kvboost_rag.core.model.loading import default_cache_root

# Where each format keeps its fp16 unit(s) in a block: random bytes there would be NaN or inf.
UNITS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
         "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def random_blocks(kind: str, rows: int, inputs: int, seed: int = 0) -> np.ndarray:
    qtype = GGMLQuantizationType[kind]
    per_block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * inputs // per_block, size), dtype=np.uint8)
    for at in UNITS[kind]:
        unit = rng.uniform(-0.02, 0.02, len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = unit.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(data: np.ndarray, kind: str) -> np.ndarray:
    return dequantize(data, GGMLQuantizationType[kind]).astype(np.float32)


def assert_levels_give(data: np.ndarray, kind: str, inputs: int) -> None:
    lv = levels(data, kind, inputs)
    assert lv.q.dtype == np.uint8 and lv.q.shape == (data.shape[0], inputs)
    assert lv.q.max() < 2**lv.bits and lv.scale.shape == (data.shape[0], inputs // lv.group)
    expected, got = reference(data, kind), dequantized(lv)
    if kind in LEGACY or lv.units is not None:  # the file's own scales (Q4_K: its units
        # times its integer multipliers, exact in float32): the same values
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    else:  # two-level scales and mins rounded to fp16: half an ulp of each term
        per_input = lambda t: np.repeat(np.abs(t.astype(np.float32)), lv.group, axis=1)  # noqa: E731
        scale, mins = lv.scales()
        terms = per_input(scale) * np.abs(lv.q.astype(np.float32) - lv.zero)
        if mins is not None:
            terms += per_input(mins)
        assert (np.abs(got - expected) <= 2**-11 * terms + 1e-9).all()


@pytest.mark.parametrize("kind", FORMATS)
def test_random_blocks_of_every_format_read_as_gguf_py_dequantizes_them(kind: str) -> None:
    assert_levels_give(random_blocks(kind, 8, 512), kind, 512)


def test_four_bit_formats_keep_nibbles_q6_k_six_bits_and_others_a_byte() -> None:
    bits = {kind: levels(random_blocks(kind, 1, 256), kind, 256).bits for kind in FORMATS}
    assert bits == {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8,
                    "Q8_0": 8, "Q6_K": 6}  # fmt: skip
    assert levels(random_blocks("Q6_K", 1, 256), "Q6_K", 256).group == 16


def test_a_format_without_a_kernel_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="IQ4_XS has no block kernel"):
        levels(np.zeros((1, 136), np.uint8), "IQ4_XS", 256)


@pytest.mark.parametrize(
    "alias",
    ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"],
)
def test_the_embedded_files_tensors_read_as_gguf_py_dequantizes_them(alias: str) -> None:
    if not embedded_available(alias):
        pytest.skip(f"{alias}'s packages are not installed")
    reader = GGUFReader(gguf_path(alias, default_cache_root()))
    seen: set[str] = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in FORMATS and kind not in seen and len(tensor.shape) == 2:
            seen.add(kind)
            data = np.asarray(tensor.data)[:64]  # the first rows: every layout is per row
            assert_levels_give(data, kind, int(tensor.shape[0]))
    assert seen, f"{alias}'s file holds no block format"
