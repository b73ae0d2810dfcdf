"""Moving cached keys to a new position by one more RoPE rotation.

RoPE rotations compose: a key rotated for position p becomes the key for p + d when
rotated once more by d. The model's own ``rotary_emb`` gives cos/sin for d, which covers
every rope variant whose rotation is linear in position (default, linear, llama3, ...).
"""

from __future__ import annotations

from typing import Any

import torch


def rotary_embedding(model: Any) -> Any | None:
    """The model's rotary embedding module, or None for models without RoPE."""
    inner = getattr(model, "model", model)
    return getattr(inner, "rotary_emb", None)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Rotation = tuple[torch.Tensor, torch.Tensor]


def rotation(delta: int, rotary: Any, like: torch.Tensor) -> Rotation:
    """cos/sin of a rotation by ``delta`` positions, shaped to broadcast over
    ``[batch, heads, seq, head_dim]`` keys."""
    position = torch.tensor([[delta]], device=like.device)
    cos, sin = rotary(like.float(), position)
    # Some variants (yarn, longrope) scale cos/sin by an attention factor: a pure rotation
    # must not apply it twice.
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    return cos[:, None] / scale, sin[:, None] / scale


def rerotate(keys: torch.Tensor, rot: Rotation) -> torch.Tensor:
    """Keys ``[batch, heads, seq, head_dim]`` rotated once more (computed in fp32)."""
    cos, sin = rot
    k = keys.float()
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)
