"""Moving cached keys to a new position by one more RoPE rotation.

RoPE rotations compose: a key rotated for position p becomes the key for p + d when
rotated once more by d. The model's own rotary module gives cos/sin for d, which covers
every rope variant whose rotation is linear in position (default, linear, llama3, ...).
Layers may rotate differently (Gemma 3: local layers base 10k, global layers 1M; SmolLM3:
some layers without RoPE), so rotations are per layer: ``kvboost_rag.core.model.arch`` says which
``Rotary`` each layer's keys carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

Rotation = tuple[torch.Tensor, torch.Tensor]  # cos, sin


def rotary_embedding(model: Any) -> Any | None:
    """The model's rotary embedding module, or None for models without RoPE."""
    inner = getattr(model, "model", model)
    return getattr(inner, "rotary_emb", None)


@dataclass(frozen=True)
class Rotary:
    """The RoPE one decoder layer applies to its keys."""

    module: Any  # the model's rotary embedding module
    # Where one module holds a base per layer type (Gemma 3), the type this layer uses.
    layer_type: str | None = None

    def cos_sin(self, like: torch.Tensor, positions: torch.Tensor) -> Rotation:
        if self.layer_type is None:
            return self.module(like, positions)  # type: ignore[no-any-return]
        return self.module(like, positions, self.layer_type)  # type: ignore[no-any-return]

    @property
    def rope_type(self) -> str:
        kind = getattr(self.module, "rope_type", "default")
        return str(kind[self.layer_type] if isinstance(kind, dict) else kind)

    @property
    def scale(self) -> float:
        """The attention factor some variants (yarn, longrope) fold into cos/sin."""
        prefix = "" if self.layer_type is None else f"{self.layer_type}_"
        return float(getattr(self.module, f"{prefix}attention_scaling", 1.0))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotation(delta: int, rotary: Rotary | Any, like: torch.Tensor) -> Rotation:
    """cos/sin of a rotation by ``delta`` positions, shaped to broadcast over
    ``[batch, heads, seq, head_dim]`` keys. ``rotary``: a ``Rotary`` or a rotary module."""
    rotary = rotary if isinstance(rotary, Rotary) else Rotary(rotary)
    position = torch.tensor([[delta]], device=like.device)
    cos, sin = rotary.cos_sin(like.float(), position)
    # A pure rotation must not apply the attention factor a second time.
    return cos[:, None].float() / rotary.scale, sin[:, None].float() / rotary.scale


def rotations(
    delta: int, rotaries: Sequence[Rotary | None], like: torch.Tensor
) -> list[Rotation | None]:
    """Per layer, the rotation by ``delta`` (None for a layer whose keys carry no RoPE);
    computed once per distinct ``Rotary``."""
    done: dict[Rotary, Rotation] = {}
    for rotary in rotaries:
        if rotary is not None and rotary not in done:
            done[rotary] = rotation(delta, rotary, like)
    return [None if rotary is None else done[rotary] for rotary in rotaries]


def rerotate(keys: torch.Tensor, rot: Rotation | None) -> torch.Tensor:
    """Keys ``[batch, heads, seq, head_dim]`` rotated once more (computed in fp32). With
    partial rotary (Phi-3), only the leading dims cos/sin cover are rotated."""
    if rot is None:
        return keys
    cos, sin = rot
    dim = cos.shape[-1]
    k = keys.float()
    if dim == k.shape[-1]:  # the usual case: no slicing and no concatenation to pay for
        return (k * cos + rotate_half(k) * sin).to(keys.dtype)
    turned = k[..., :dim] * cos + rotate_half(k[..., :dim]) * sin
    return torch.cat([turned, k[..., dim:]], dim=-1).to(keys.dtype)
