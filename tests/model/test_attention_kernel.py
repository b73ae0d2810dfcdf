"""Our few-query attention kernel against the same attention in float64 torch: every shape
a decoding step gives it (one query or a draft's few, a batch of rows, keys in and across
its chunks, strided caches, boolean masks), in the dtypes it takes."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag.core.model import attention_kernel, block_kernel
from kvboost_rag.core.model.attention import few_query_attention

pytestmark = pytest.mark.skipif(
    block_kernel.missing() is not None, reason=f"no kernel here: {block_kernel.missing()}"
)


def reference(query, key, value, mask, scale):  # type: ignore[no-untyped-def]
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, 1)
    v = value.double().repeat_interleave(groups, 1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)  # [batch, q, heads, dim]


def inputs(batch, heads, kv_heads, q, keys, dim, dtype, masked, seed=0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    # the query as a model's projection gives it ([batch, q, heads, dim] transposed) and the
    # cache as slot buffers do (a longer capacity, sliced to the row's keys)
    query = torch.randn(batch, q, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    cache = torch.randn(2, batch, kv_heads, keys + 37, dim, generator=gen).to(dtype)
    key, value = cache[0, :, :, :keys], cache[1, :, :, :keys]
    mask = None
    if masked:
        mask = torch.rand(batch, 1, q, keys, generator=gen) < 0.7
        mask[..., -1] = True  # every query attends to a key
    return query, key, value, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,heads,kv_heads,q,keys,dim",
    [
        (1, 12, 2, 1, 1, 128),
        (1, 12, 2, 1, 700, 128),
        (1, 9, 3, 1, 256, 64),
        (2, 12, 2, 3, 257, 128),
        (3, 4, 4, 4, 513, 32),
        (1, 8, 1, 2, 1030, 256),
    ],
)
@pytest.mark.parametrize("masked", [False, True])
def test_the_kernel_gives_the_attention(
    dtype: torch.dtype, batch: int, heads: int, kv_heads: int, q: int, keys: int, dim: int,
    masked: bool,
) -> None:  # fmt: skip
    query, key, value, mask = inputs(batch, heads, kv_heads, q, keys, dim, dtype, masked)
    scale = dim**-0.5
    got = attention_kernel.compute(query, key, value, mask, scale)
    assert got is not None and got.dtype == dtype and got.shape == (batch, q, heads, dim)
    want = reference(query, key, value, mask, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    else:  # the float32 result rounded once to bf16: within one of its units
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3)


def test_few_query_attention_takes_the_kernel_and_matches_the_torch_form() -> None:
    query, key, value, mask = inputs(2, 12, 2, 2, 300, 128, torch.bfloat16, masked=True)
    full = torch.ones(2, 1, 5, 310, dtype=torch.bool)  # as the step's mask: wider, more rows
    full[:, :, -2:, :300] = mask[:, 0:1]
    via = few_query_attention(None, query, key, value, full, None)
    kernel = attention_kernel.compute(query, key, value, full[:, :, -2:, :300], 128**-0.5)
    assert kernel is not None and torch.equal(via, kernel)  # the boolean mask took the kernel
    torch_form = few_query_attention(None, query, key, value, full.float().log(), None)
    torch.testing.assert_close(via.float(), torch_form.float(), rtol=2**-7, atol=1e-3)


def test_what_the_kernel_does_not_take_is_left_to_torch() -> None:
    query, key, value, _ = inputs(1, 4, 2, 1, 10, 24, torch.float32, masked=False)
    assert attention_kernel.compute(query, key, value, None, 0.2) is None  # dim not 16n
    query, key, value, _ = inputs(1, 4, 2, 1, 10, 32, torch.float16, masked=False)
    assert attention_kernel.compute(query, key, value, None, 0.2) is None
    query, key, value, _ = inputs(1, 4, 2, 1, 10, 32, torch.float32, masked=False)
    additive = torch.zeros(1, 1, 1, 10)
    assert attention_kernel.compute(query, key, value, additive, 0.2) is None
