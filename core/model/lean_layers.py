"""A Llama-family decoder layer's small operators on our kernel (``kernels/layer_ops.c``),
in a model whose linear layers are a GGUF's blocks (``from_pretrained(weights="gguf")``).

On blocks, a Qwen2.5-Coder-1.5B decoding step reads ~1 GB of weights in ~30 ms, and
transformers' modules around them (RMSNorm as 8 operators, RoPE as 12, SiLU and its
product, the residual adds) called ~1,400 torch operators more, ~5 ms of dispatch on this
2-core EPYC (``docs/bench/decode.md``). Here each RMSNorm is one call (the residual add
before the post-attention norm in it), RoPE one call for the queries and one for the keys,
SiLU(gate) * up one call on the joint gate-up product. Each rounds where transformers'
operators round (``layer_ops.c``), so a layer's output is transformers' to within a last
bit of the variance's sum or SiLU's exp (``tests/model/test_lean_layers.py``).

Installed with the blocks, on the loaded model itself (which the blocks already made ours):
its ``generate`` and the engine's copy (``view.py``) then compute alike, as an int8
quantization of activations turns a last-bit difference into a whole level now and then.
A call these forms do not take (another dtype, a device other than the CPU, a tensor laid
out otherwise, an attention implementation outside the registry) runs transformers' own
forward.
"""

from __future__ import annotations

import types
from functools import cache
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvboost_rag.core.model import block_kernel
from kvboost_rag.core.model.blocks import BlockLinear
from kvboost_rag.core.model.loading import default_cache_root

# Classes whose forwards these replace, by name: their structure is checked too (``_fits``).
LAYERS = ("Qwen2DecoderLayer", "LlamaDecoderLayer")
NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm")
ACTIVATIONS = ("SiLUActivation", "SiLU")  # transformers' ``ACT2FN["silu"]``, torch's
DTYPES = (torch.bfloat16, torch.float32)


@cache
def _library() -> Any:
    return block_kernel.optional(default_cache_root(), block_kernel.LAYER_OPS)


def install(model: Any) -> int:
    """Give ``model``'s decoder layers (those of a known class and shape) and RMSNorms the
    lean forwards, where its linear layers include blocks; how many layers took them."""
    if _library() is None or not any(isinstance(m, BlockLinear) for m in model.modules()):
        return 0
    return lean(model)


def lean(model: Any) -> int:
    """``install``'s forwards on every layer of ``model`` that fits, blocks or not (tests
    compare them with transformers' on float weights); how many layers took them."""
    layers = [m for m in model.modules() if type(m).__name__ in LAYERS and _fits(m)]
    for layer in layers:
        layer.forward = types.MethodType(_layer_forward, layer)
        layer.self_attn.forward = types.MethodType(_attention_forward, layer.self_attn)
    for module in model.modules():
        if type(module).__name__ in NORMS and module.weight.shape[-1] % 16 == 0:
            module.forward = types.MethodType(_norm_forward, module)
    return len(layers)


def _fits(layer: Any) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    )
    if attn is None or mlp is None or any(type(n).__name__ not in NORMS for n in norms):
        return False
    if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
        return False
    if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        return False
    silu = type(getattr(mlp, "act_fn", None)).__name__ in ACTIVATIONS
    sizes = (layer.input_layernorm.weight.shape[-1], mlp.gate_proj.out_features, attn.head_dim)
    return silu and all(size % 16 == 0 for size in sizes) and attn.head_dim % 32 == 0


def _takes(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (
        first.dtype in DTYPES
        and first.device.type == "cpu"
        and all(t.dtype is first.dtype and t.is_contiguous() for t in tensors)
    )


def _norm(norm: Any, x: torch.Tensor, add: torch.Tensor | None = None) -> tuple[Any, Any]:
    """``norm(x + add)`` and ``x + add`` (``add`` None: ``norm(x)`` and x) on the kernel."""
    dim = x.shape[-1]
    out = torch.empty_like(x)
    total = None if add is None else torch.empty_like(x)
    _library().rms_norm(
        x.data_ptr(), None if add is None else add.data_ptr(),
        None if total is None else total.data_ptr(), norm.weight.data_ptr(), out.data_ptr(),
        x.dtype is torch.bfloat16, x.numel() // dim, dim, norm.variance_epsilon,
        torch.get_num_threads(),
    )  # fmt: skip
    return out, x if total is None else total


def _norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    if not _takes(hidden_states, self.weight):
        return type(self).forward(self, hidden_states)  # type: ignore[no-any-return]
    return _norm(self, hidden_states)[0]  # type: ignore[no-any-return]


def _layer_forward(
    self: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    cache = kwargs.pop("past_key_values", cache)
    norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
    if not _takes(hidden_states, *norms):
        return type(self).forward(  # type: ignore[no-any-return]
            self, hidden_states, attention_mask, position_ids, cache=cache,
            use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        )  # fmt: skip
    normed, _ = _norm(self.input_layernorm, hidden_states)
    attended, _ = self.self_attn(
        hidden_states=normed, attention_mask=attention_mask, position_ids=position_ids,
        cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )  # fmt: skip
    if not _takes(hidden_states, attended):
        attended = attended.contiguous()
    normed, hidden_states = _norm(self.post_attention_layernorm, hidden_states, attended)
    return hidden_states + _mlp(self.mlp, normed)


def _mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_proj, mlp.up_proj
    siblings: Any = getattr(gate, "siblings", None)
    joint = siblings is not None and siblings is getattr(up, "siblings", None)
    if joint and gate.sibling == 0 and up.sibling == 1 and len(siblings.sizes) == 2:
        both = siblings.whole.forward(x)
        g, u = both[..., : gate.out_features], both[..., gate.out_features :]
    else:
        g, u = gate(x), up(x)
        if not _takes(g, u):
            return mlp.down_proj(mlp.act_fn(g) * u)  # type: ignore[no-any-return]
    inter = gate.out_features
    act = torch.empty(*x.shape[:-1], inter, dtype=g.dtype)
    _library().silu_mul(
        g.data_ptr(), u.data_ptr(), g.stride(-2), act.data_ptr(), g.dtype is torch.bfloat16,
        act.numel() // inter, inter, torch.get_num_threads(),
    )  # fmt: skip
    return mlp.down_proj(act)  # type: ignore[no-any-return]


def _attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    cache = kwargs.pop("past_key_values", cache)
    cos, sin = position_embeddings
    batch, seq, dim = *hidden_states.shape[:-1], self.head_dim
    name = self.config._attn_implementation
    if not (
        hidden_states.dim() == 3
        and name in ALL_ATTENTION_FUNCTIONS
        and _takes(hidden_states, cos, sin)
        and cos.shape[0] in (1, batch)
        and cos.shape[1:] == (seq, dim)
    ):
        return type(self).forward(  # type: ignore[no-any-return]
            self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs
        )
    q, k, v = _projections(self, hidden_states)
    query, key = _rope(q, cos, sin, batch, seq, dim), _rope(k, cos, sin, batch, seq, dim)
    value = v.view(batch, seq, -1, dim).transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    out, weights = ALL_ATTENTION_FUNCTIONS[name](
        self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", None), **kwargs,
    )  # fmt: skip
    return self.o_proj(out.reshape(batch, seq, -1).contiguous()), weights


def _projections(attn: Any, x: torch.Tensor) -> list[torch.Tensor]:
    """The query, key and value projections of ``x``, a view of one joint product for each
    that the blocks joined (``sibling_blocks.py``), computed once, not through each sibling."""
    joints: dict[int, torch.Tensor] = {}
    out = []
    for layer in (attn.q_proj, attn.k_proj, attn.v_proj):
        siblings: Any = getattr(layer, "siblings", None)
        if siblings is None:
            out.append(layer(x))
            continue
        if id(siblings) not in joints:
            joints[id(siblings)] = siblings.whole.forward(x)
        start, size = sum(siblings.sizes[: layer.sibling]), siblings.sizes[layer.sibling]
        out.append(joints[id(siblings)][..., start : start + size])
    return out


def _rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: int, seq: int, dim: int
) -> torch.Tensor:
    """RoPE on a projection's output ``x`` [batch, seq, heads * dim]: [batch, heads, seq,
    dim], as transformers' ``apply_rotary_pos_emb`` gives it after its transpose."""
    if x.dtype is not cos.dtype or x.stride(-1) != 1 or x.stride(0) != seq * x.stride(1):
        x = x.contiguous().to(cos.dtype)  # a projection in another dtype or layout: rare
    heads = x.shape[-1] // dim
    out = torch.empty(batch, heads, seq, dim, dtype=x.dtype)
    _library().rope(
        x.data_ptr(), x.stride(1), cos.data_ptr(), sin.data_ptr(), cos.shape[0] == 1,
        out.data_ptr(), x.dtype is torch.bfloat16, batch, seq, heads, dim, torch.get_num_threads(),
    )  # fmt: skip
    return out
