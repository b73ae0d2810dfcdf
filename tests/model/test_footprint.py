"""The bytes a decoding step reads (``model/footprint.py``): every weight in full but the
embedding table (one row), the head once even when tied, and of a quantized layer what its
kernel reads; counted by hand on tiny models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_model

from kvboost_rag.core.model import block_kernel
from kvboost_rag.core.model.footprint import step_bytes
from kvboost_rag.core.model.quantized import QuantizedLinear, quantize
from kvboost_rag.core.model.view import engine_view


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def by_hand(model: torch.nn.Module) -> int:
    """Every parameter and buffer once, the embedding table's one row instead of all."""
    table = model.get_input_embeddings().weight
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    whole = sum(nbytes(t) for key, t in tensors.items() if key != id(table))
    return whole + nbytes(table[0])


def test_a_dense_model_reads_every_weight_and_one_embedding_row() -> None:
    model = make_model("llama")
    assert step_bytes(model) == by_hand(model)


def test_the_embedding_table_counts_one_row() -> None:
    model = make_model("llama")
    table = model.get_input_embeddings().weight
    model.set_input_embeddings(torch.nn.Embedding(10 * table.shape[0], table.shape[1]))
    assert step_bytes(model) == by_hand(make_model("llama"))  # a longer table, the same row


def test_a_head_tied_to_the_embeddings_counts_once_in_full() -> None:
    model = make_model("llama")
    model.lm_head.weight = model.get_input_embeddings().weight
    table = model.lm_head.weight
    others = sum(nbytes(t) for n, t in model.named_parameters() if t is not table)
    buffers = sum(nbytes(t) for t in model.buffers())
    assert step_bytes(model) == others + buffers + nbytes(table)


def test_the_engine_view_reads_what_the_model_does() -> None:
    model = make_model("qwen2")  # a bias in the attention's projections
    assert step_bytes(engine_view(model)) == step_bytes(model)


def test_int4_reads_its_packed_weight_and_scales_not_its_nibbles() -> None:
    model = make_model("llama")
    dense = step_bytes(model)
    layers = quantize(model, "int4")
    assert step_bytes(model) < dense / 4  # fp32 weights, 4-bit levels
    layer = layers[0]
    layer.rows = 1
    alone = nbytes(layer.packed) + nbytes(layer.scales_and_zeros)
    assert step_bytes(torch.nn.Sequential(layer)) == alone
    layer.rows = 0  # dequantized at every count: the nibbles are read instead
    alone = nbytes(layer.nibbles) + nbytes(layer.scales_and_zeros)
    assert step_bytes(torch.nn.Sequential(layer)) == alone


def test_int8_reads_its_levels_and_row_scales() -> None:
    layer = QuantizedLinear(torch.nn.Linear(256, 96), "int8", rows=1)
    expected = nbytes(layer.q) + nbytes(layer.scale) + nbytes(layer.bias)
    assert step_bytes(torch.nn.Sequential(layer)) == expected == 256 * 96 + 2 * 4 * 96


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_int8_dynamic_reads_onednns_packed_copy_not_its_own_levels() -> None:
    layer = QuantizedLinear(torch.nn.Linear(256, 96, bias=False), "int8-dynamic")
    expected = nbytes(layer.onednn_weight) + nbytes(layer.scale) + nbytes(layer.zero_points)
    assert step_bytes(torch.nn.Sequential(layer)) == expected == 256 * 96 + 2 * 4 * 96


@pytest.mark.skipif(not block_kernel.available(), reason="the block kernel cannot run here")
def test_gguf_blocks_read_levels_scales_and_mins_not_the_header(tmp_path: Path) -> None:
    from kvboost_rag.core.model.blocks import BlockLinear, pack
    from kvboost_rag.core.model.gguf_blocks import Levels

    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (32, 64), dtype=np.uint8)
    scale = rng.uniform(0, 0.1, (32, 2)).astype(np.float16)
    packed = pack(Levels(q, scale, scale.copy(), 0, 4, 32))
    layer = BlockLinear(packed, None, tmp_path)
    expected = 32 * 64 // 2 + 2 * (2 * 32 * 2)  # nibbles, fp16 scales and mins
    assert step_bytes(torch.nn.Sequential(layer)) == expected
    assert nbytes(layer.info) > 0  # held, not read by the kernel
