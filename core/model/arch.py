"""What the engine must know about a model's structure, read once when an engine starts.

Decoder layers and their attention modules, the RoPE each layer's keys carry, the layers
that attend through a sliding window, and from these the one decision made here and
nowhere else: may cached passages move to new positions (passage reuse), or does the
engine keep to exact prefix reuse, and why.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvboost_rag.core.errors import UnsupportedModelError
from kvboost_rag.core.model import hf_compat
from kvboost_rag.core.model.kv import layer_kv, to_cache
from kvboost_rag.core.model.measurements import FORGETFUL, Measurements
from kvboost_rag.core.model.rope import Rotary, rerotate, rotary_embedding, rotations

FULL, SLIDING = "full_attention", "sliding_attention"
# Layer types whose cache is per-position attention KV; any other (linear attention, conv
# states, KV shared from another layer) cannot be sliced by position, even for prefix reuse.
KV_LAYER_TYPES = frozenset({FULL, SLIDING, "chunked_attention"})
# Rope variants that rescale their frequencies with the sequence length: a key's rotation
# then depends on the whole prompt's length, not only on its own position.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
# The rotation probe (``rotation_errors``): relative error allowed per dtype. Measured on
# SmolLM2-135M and Gemma 3 270M: fp32 ~3e-7, fp16 ~6e-4, bf16 ~3e-3; one rotation for all of
# Gemma 3's layers (a wrong base for its local layers) gives 0.94.
PROBE_TOKENS, PROBE_SHIFT = 8, 61
# The probe's verdict is kept (``measurements.py``) for models of at least this many
# parameters: smaller ones probe in milliseconds, and tests make thousands of them.
KEPT_PARAMETERS = 1 << 24
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_PROBE_TOLERANCE = 0.03


@dataclass(frozen=True)
class ModelSupport:
    layers: tuple[Any, ...]  # decoder layers, in order (empty where they were not found)
    attention: tuple[Any, ...]  # each layer's self-attention module
    layer_types: tuple[str, ...]  # per layer, transformers' cache type ("full_attention", ...)
    sliding_window: int | None  # positions a sliding layer sees, itself included
    rotaries: tuple[Rotary | None, ...]  # per layer, the RoPE its keys carry (None: none)
    passage_reuse: bool  # cached passages may move to new positions
    reason: str | None  # why passage reuse is off, when it is

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer, its sliding window (None: full attention), as ``attention.Forward`` takes
        them."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    def attention_masks(
        self, build: Callable[[int | None], torch.Tensor]
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """A custom 4D attention mask as the model's forward takes it. ``build(window)``
        makes it for full attention (None) or for a sliding window of that many positions;
        models that mix both (Gemma 2/3, Qwen2) take one mask per layer type."""
        if SLIDING not in self.layer_types:
            return build(None)
        if FULL not in self.layer_types:
            return build(self.sliding_window)
        return {FULL: build(None), SLIDING: build(self.sliding_window)}


_GUARD = threading.Lock()
_KNOWN: weakref.WeakKeyDictionary[Any, ModelSupport] = weakref.WeakKeyDictionary()


def model_support(model: Any, measurements: Measurements = FORGETFUL) -> ModelSupport:
    """The structure of ``model``, inspected (and its rotation probed, or the probe's
    verdict recalled from ``measurements``) once per model object.

    Raises ``UnsupportedModelError`` for models whose cache is not attention KV.
    """
    with _GUARD:
        support = _KNOWN.get(model)
        if support is None:
            support = _KNOWN[model] = inspect_model(model, measurements)
        return support


def copy_support(copied: Any, support: ModelSupport) -> ModelSupport:
    """The support of ``copied``, a copy of the model ``support`` describes (``view.py``):
    its own layers and attention modules, the same verdict (no probe run again)."""
    _, layers, attention = _structure(copied)
    copy = replace(support, layers=layers, attention=attention)
    with _GUARD:
        _KNOWN[copied] = copy
    return copy


def inspect_model(model: Any, measurements: Measurements = FORGETFUL) -> ModelSupport:
    name = type(model).__name__
    config = model.config.get_text_config(decoder=True)
    layer_types, kwargs = hf_compat.layer_types(config)
    if not set(layer_types) <= KV_LAYER_TYPES:
        raise UnsupportedModelError(
            f"{name} has {sorted(set(layer_types) - KV_LAYER_TYPES)} layers; kvboost-rag "
            f"reuses attention KV by position and supports {sorted(KV_LAYER_TYPES)} layers"
        )
    decoder, layers, attention = _structure(model)
    windows = {kw["sliding_window"] for kw in kwargs if "sliding_window" in kw}
    support = ModelSupport(
        layers=layers,
        attention=attention,
        layer_types=tuple(layer_types),
        sliding_window=min(windows) if windows else None,
        rotaries=_rotaries(decoder, config, layer_types),
        passage_reuse=False,
        reason=None,
    )
    reason = _refusal(name, support, windows) or _probe(model, support, measurements)
    return replace(support, passage_reuse=reason is None, reason=reason)


def _structure(model: Any) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """``model``'s decoder, its layers and each layer's attention module (None if absent)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = tuple(getattr(decoder, "layers", ()))
    return decoder, layers, tuple(getattr(layer, "self_attn", None) for layer in layers)


def _rotaries(decoder: Any, config: Any, layer_types: list[str]) -> tuple[Rotary | None, ...]:
    module = rotary_embedding(decoder)
    if module is None:
        return (None,) * len(layer_types)
    # One module holding a base per layer type takes the type as an argument (Gemma 3).
    per_type = "layer_type" in inspect.signature(module.forward).parameters
    # SmolLM3-style NoPE layers: 0 marks a layer whose keys carry no position at all.
    uses_rope = getattr(config, "no_rope_layers", None) or [1] * len(layer_types)
    return tuple(
        Rotary(module, kind if per_type else None) if use else None
        for kind, use in zip(layer_types, uses_rope)
    )


def _refusal(name: str, support: ModelSupport, windows: set[int]) -> str | None:
    """Why passage reuse cannot work on this structure, or None."""
    if all(rotary is None for rotary in support.rotaries):
        return (
            f"{name} has no rotary position embedding, so cached passages cannot move "
            "to new positions"
        )
    if not support.layers or any(attn is None for attn in support.attention):
        return f"{name}: no decoder layers with a self_attn module found to repair passages"
    length_dependent = {r.rope_type for r in support.rotaries if r} & LENGTH_DEPENDENT_ROPE
    if length_dependent:
        return (
            f"{name} uses {sorted(length_dependent)} RoPE, whose rotation depends on the "
            "prompt's length, so cached keys cannot be moved by a rotation"
        )
    if "chunked_attention" in support.layer_types or len(windows) > 1:
        return f"{name} mixes attention windows the repair pass cannot mask"
    return None


def _probe(model: Any, support: ModelSupport, measurements: Measurements) -> str | None:
    """Why re-rotated keys are wrong for this model, or None; recalled from
    ``measurements`` where this machine probed the same model (by its fingerprint)."""
    key = {"model": measurements.model, "probe": [PROBE_TOKENS, PROBE_SHIFT, _tolerance(model)]}
    kept = measurements.recall("rotation", key) if measurements.model else None
    if isinstance(kept, dict) and isinstance(kept.get("reason"), (str, type(None))):
        return kept["reason"]  # type: ignore[no-any-return]
    reason = None
    for layer, error in enumerate(rotation_errors(model, support)):
        if error > _tolerance(model):
            reason = (
                f"{type(model).__name__}: keys of layer {layer} re-rotated to a new "
                f"position differ from a fresh encode there (relative error {error:.2g})"
            )
            break
    if measurements.model and sum(p.numel() for p in model.parameters()) >= KEPT_PARAMETERS:
        measurements.keep("rotation", key, {"reason": reason})
    return reason


def _tolerance(model: Any) -> float:
    return PROBE_TOLERANCE.get(model.dtype, HALF_PROBE_TOLERANCE)


def rotation_errors(model: Any, support: ModelSupport) -> list[float]:
    """Per layer, how far keys encoded at position 0 and re-rotated by ``PROBE_SHIFT`` are
    from the same tokens encoded there (relative norm). This catches RoPE layouts the
    structure does not show (interleaved pairs, ...). One forward of two rows: the tokens
    at positions 0.. and at ``PROBE_SHIFT``..; each attention layer gets the first row's
    input in both rows, so their keys differ by the rotation alone: bf16 drift through
    depth (0.5 by layer 12 of SmolLM2) is not taken for a wrong one."""
    device = model.device
    ids = torch.arange(3, 3 + PROBE_TOKENS, device=device)[None] % model.config.vocab_size
    positions = torch.arange(PROBE_TOKENS, device=device)[None] + torch.tensor(
        [[0], [PROBE_SHIFT]], device=device
    )
    hooks = [
        attn.register_forward_pre_hook(_first_row_input, with_kwargs=True)
        for attn in support.attention
    ]
    try:
        with torch.inference_mode():
            cache = to_cache([], model.config)
            rows = ids.expand(2, -1)
            model(input_ids=rows, position_ids=positions, cache=cache, logits_to_keep=1)
            keys = [k.float() for k, _ in layer_kv(cache)]
    finally:
        for hook in hooks:
            hook.remove()
    rots = rotations(PROBE_SHIFT, support.rotaries, keys[0][:1])
    return [
        float((rerotate(k[:1], rot) - k[1:]).norm() / k[1:].norm().clamp_min(1e-12))
        for k, rot in zip(keys, rots)
    ]


def _first_row_input(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A pre-hook giving an attention layer its first row's input in every row."""
    positional = "hidden_states" not in kwargs
    hidden = args[0] if positional else kwargs["hidden_states"]
    same = hidden[:1].expand_as(hidden).clone()
    if positional:
        return (same, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": same}
