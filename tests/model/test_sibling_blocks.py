"""Sibling block layers joined into one product (``sibling_blocks.py``): each sibling's
output is bit for bit its own product, whatever order and inputs they are called with, and
a model's copy shares the joint weights."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_blocks import random_levels

from kvboost_rag.core.model import block_kernel
from kvboost_rag.core.model.blocks import BlockLinear, pack
from kvboost_rag.core.model.sibling_blocks import join

pytestmark = pytest.mark.skipif(
    not block_kernel.available(), reason=f"block kernel: {block_kernel.missing()}"
)


class Attention(torch.nn.Module):
    """A Llama-family attention's projections: q/k/v read the hidden states, o another."""

    def __init__(self, tmp_path: Path, v_bits: int = 4) -> None:
        super().__init__()
        shapes = {"q_proj": (64, 4), "k_proj": (32, 4), "v_proj": (32, v_bits), "o_proj": (64, 4)}
        for i, (name, (rows, bits)) in enumerate(shapes.items()):
            levels = random_levels(rows, 64, bits, 32, asym=bits == 4)
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(i))
            setattr(
                self, name, BlockLinear(pack(levels), None if name == "o_proj" else bias, tmp_path)
            )


def alone(layer: BlockLinear, x: torch.Tensor) -> torch.Tensor:
    siblings, layer.siblings = layer.siblings, None
    try:
        return layer(x)
    finally:
        layer.siblings = siblings


@pytest.mark.parametrize("rows", [1, 7])
def test_siblings_give_their_own_products_in_any_order(rows: int, tmp_path: Path) -> None:
    module = Attention(tmp_path)
    x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
    want = {n: module.get_submodule(n)(x) for n in ("q_proj", "k_proj", "v_proj")}
    assert join(module) == 1
    assert module.o_proj.siblings is None  # same input size, another input: not joined
    for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj")):
        for name in order:
            got = module.get_submodule(name)(x)
            assert got.shape == want[name].shape and torch.equal(got, want[name]), name
    # one sibling twice on one input, and siblings on other inputs: each its own product
    y = torch.randn(2, rows, 64, dtype=torch.bfloat16)
    assert torch.equal(module.q_proj(y), alone(module.q_proj, y))
    assert torch.equal(module.q_proj(y), alone(module.q_proj, y))
    assert torch.equal(module.k_proj(x), want["k_proj"])
    assert torch.equal(module.v_proj(y), alone(module.v_proj, y))


def test_only_layers_of_one_format_are_joined(tmp_path: Path) -> None:
    module = Attention(tmp_path, v_bits=8)  # a Q6_K value projection beside Q4_K q and k
    assert join(module) == 1
    assert module.q_proj.siblings is module.k_proj.siblings is not None
    assert module.v_proj.siblings is None
    x = torch.randn(3, 64)
    assert torch.equal(module.v_proj(x), alone(module.v_proj, x))


def test_a_copy_shares_the_joint_weights_not_the_outputs(tmp_path: Path) -> None:
    module = Attention(tmp_path)
    join(module)
    twin = copy.deepcopy(module, memo={id(t): t for t in module.buffers()})
    assert twin.q_proj.siblings is twin.k_proj.siblings is not module.q_proj.siblings
    assert twin.q_proj.siblings.whole.q.data_ptr() == module.q_proj.siblings.whole.q.data_ptr()
    x, y = torch.randn(1, 64), torch.randn(1, 64)
    q_x, q_y = module.q_proj(x), twin.q_proj(y)  # each model's stash its own
    assert torch.equal(module.k_proj(x), alone(module.k_proj, x))
    assert torch.equal(twin.k_proj(y), alone(twin.k_proj, y))
    assert torch.equal(q_x, alone(module.q_proj, x)) and torch.equal(q_y, alone(twin.q_proj, y))


def test_nothing_is_kept_once_every_sibling_took_its_part(tmp_path: Path) -> None:
    module = Attention(tmp_path)
    join(module)
    x = torch.randn(300, 64)
    module.q_proj(x), module.k_proj(x)
    assert module.q_proj.siblings._stash is not None  # v's part waits for it
    module.v_proj(x)
    assert module.q_proj.siblings._stash is None  # a prefill's outputs are not held on to
