"""The lm_head on a weight prepacked for oneDNN, in the engine's forwards (CPU).

A decoding step multiplies the lm_head's weight (vocabulary x hidden: 28M of SmolLM2's 135M
parameters) by a handful of rows, and ``torch.nn.functional.linear`` does that at a third
of the speed a oneDNN matmul on a weight reordered once into its blocked layout reaches.
Measured on a 2-core AMD EPYC (AVX2, fp32), SmolLM2-135M's lm_head in the model, 8 rows:
27.4 ms through ``F.linear``, 10.4 ms packed; one call on its own, by rows:

| rows | 1 | 2 | 8 | 32 | 64 |
|---|---|---|---|---|---|
| ``F.linear`` (ms) | 12.4 | 22.2 | 31.5 | 38.7 | 60.1 |
| packed (ms) | 8.6 | 6.7 | 11.4 | 17.3 | 30.6 |

The decoder layers' weights gained nothing from packing on that CPU (a step's linear layers
took 58 ms against 56 ms at 8 rows); on an AVX-512 one they take a third of the time, so
whether they are packed is measured per model (``linears.py``). It is what inductor's
freezing pass does to linear weights (``python -m benchmarks.decode.step``), without a compile per
model and shape.

How: the runner runs the model's decoder (``get_decoder()``) and applies the packed head
itself to the rows it keeps, so the model is not modified and a user's own calls are
untouched. The first engine on a model packs the head and checks the split when it is
made (``Runner.warm_up``), so no request pays for it: the decoder plus the packed head must
give the model's own logits on a probe. A model that does more to its
logits (Gemma 2's soft-capping, a logit scale) fails the check and keeps its forward. A head
weight changed after packing (an in-place update bumps its version, a reassigned ``.data``
moves its storage) is packed again before use. The packed copy costs one more copy of the
head in memory. By default it is used where it also measures faster at 8 rows
(``PackedHead.usable``); a head under ``MEASURED_ELEMENTS`` is not timed and not used.

The two ops are torch's private ones (inductor's lowering calls them), called through
``torch_compat`` and checked before a head or layer is packed.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from kvboost_rag.core.model import torch_compat
from kvboost_rag.core.model.measurements import Measurements
from kvboost_rag.core.model.torch_compat import packed_linear

# The row count oneDNN is told to expect when reordering (and the head's check times). At
# Qwen2.5-Coder-1.5B's head (bf16), reordered for 8 rows it took 40.0 / 39.7 / 40.8 ms at
# 1 / 8 / 9 rows, for 16 rows 37.0 / 41.1 / 38.1, for 1 row 48-50 against F.linear's 38-40
# (``scripts/step_constants.py --parts head``, docs/bench/constants-*): 8 kept.
PACK_ROWS = 8
# Heads smaller than this (elements) are not timed and keep F.linear: either way costs
# microseconds, so the timing would decide by noise, and two engines on equal tiny models
# would round their logits differently (packed and F.linear differ in the last bit).
MEASURED_ELEMENTS = 1 << 21


def supported(model: Any) -> bool:
    """Whether ``model``'s head can be packed here: on a CPU with oneDNN, in fp32 (or bf16
    where oneDNN computes it natively), torch's ops present, a plain ``nn.Linear`` head and
    a decoder to run apart."""
    if torch.device(model.device).type != "cpu":
        return False
    if _head(model) is None or not callable(getattr(model, "get_decoder", None)):
        return False
    return packs_dtype(model.dtype)


def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed matmul computes ``dtype`` here: fp32, or bf16 where oneDNN
    computes it natively; False where torch lacks the ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    if not torch_compat.usable(torch_compat.PACKED_LINEAR, "F.linear"):
        return False
    if dtype == torch.bfloat16:
        return torch_compat.mkldnn_bf16_supported()
    return bool(dtype == torch.float32)


def _head(model: Any) -> torch.nn.Linear | None:
    """The model's lm_head: its output embeddings when they are a plain ``nn.Linear``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if type(head) is torch.nn.Linear else None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered for ``packed_linear`` (``torch_compat``'s) at ``PACK_ROWS`` rows."""
    return torch_compat.reorder_linear_weight(weight.detach(), PACK_ROWS)


class PackedWeight:
    """A weight's copy reordered for oneDNN (several weights: their rows stacked, as one
    product's), reordered anew when a weight changed since: another tensor, an in-place
    update (its version moves; an inference tensor keeps none) or a reassigned ``.data``
    (its storage moves)."""

    def __init__(self) -> None:
        self._entry: tuple[tuple[torch.Tensor, ...], tuple[int, ...], torch.Tensor] | None = None

    def of(self, *weights: torch.Tensor) -> torch.Tensor:
        key = tuple(n for w in weights for n in (_version(w), w.data_ptr()))
        entry = self._entry
        if (
            entry is None
            or entry[1] != key
            or len(entry[0]) != len(weights)
            or any(a is not b for a, b in zip(entry[0], weights))
        ):
            with torch.inference_mode():
                stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
                entry = (weights, key, pack(stacked))
            self._entry = entry
        return entry[2]


def _version(weight: torch.Tensor) -> int:
    return -1 if weight.is_inference() else weight._version


class PackedHead:
    """The model's decoder and its packed head, made on first use.

    Not thread-safe: the executor's thread (one at a time) is its only user."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._packed: PackedWeight | None = None
        # whether the split is possible and right here / also faster (None: not tried yet)
        self._correct: bool | None = None if supported(model) else False
        self._faster = False
        self.seconds = 0.0  # spent packing and checking

    def usable(self, measured: bool = True) -> bool:
        """Packs the head and checks the split on the first call. False when packing is
        unsupported here, fails or gives other logits (nothing is kept then), and, with
        ``measured`` (the default choice), when it was not faster at ``PACK_ROWS`` rows."""
        if self._correct is None:
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._correct, self._faster = self._check()
            except (RuntimeError, AttributeError, TypeError):  # op missing, layout refused
                self._correct = False
            if not self._correct:
                self._packed = None
            self.seconds += time.perf_counter() - start
        return self._correct and (self._faster or not measured)

    def prepare(self, measurements: Measurements) -> None:
        """Check the split now (``usable``), or take what this machine found for the same
        model before (``measurements``, by the model's fingerprint); a check that timed
        the head is kept there."""
        head = _head(self.model)
        if self._correct is not None or head is None:
            return
        key = {"model": measurements.model, "dtype": str(self.model.dtype), "rows": PACK_ROWS}
        kept = measurements.recall("head", key) if measurements.model else None
        if isinstance(kept, list) and len(kept) == 2 and all(isinstance(k, bool) for k in kept):
            self._correct, self._faster = kept
            return
        self.usable()
        if head.weight.numel() >= MEASURED_ELEMENTS and measurements.model:
            measurements.keep("head", key, [self._correct, self._faster])

    def logits(self, keep: int, **inputs: Any) -> torch.Tensor:
        """The model's logits after the last ``keep`` tokens of each row: its decoder on
        ``inputs`` (the model's forward arguments), then the packed head."""
        hidden = self.model.get_decoder()(**inputs).last_hidden_state
        head = _head(self.model)
        assert head is not None
        return packed_linear(hidden[:, -keep:], self._weight(head.weight), head.bias)  # type: ignore[no-any-return]

    def _weight(self, weight: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            self._packed = PackedWeight()
        return self._packed.of(weight)

    def _check(self) -> tuple[bool, bool]:
        """Whether the decoder plus the packed head give the model's logits on a probe, and
        whether the packed head is faster than ``F.linear`` at ``PACK_ROWS`` rows."""
        head = _head(self.model)
        assert head is not None
        device = self.model.device
        probe = torch.arange(3, 3 + PACK_ROWS, device=device)[None] % head.out_features
        want = self.model(input_ids=probe).logits.float()
        got = self.logits(PACK_ROWS, input_ids=probe).float()
        tolerance = 1e-4 if self.model.dtype == torch.float32 else 3e-2
        if (got - want).abs().max().item() > tolerance * max(want.abs().max().item(), 1.0):
            return False, False
        if head.weight.numel() < MEASURED_ELEMENTS:
            return True, False
        x = torch.randn(PACK_ROWS, head.in_features, dtype=head.weight.dtype, generator=_SEED)
        packed = self._weight(head.weight)
        packed_s = median_seconds(lambda: packed_linear(x, packed, head.bias), repeats=3)
        plain_s = median_seconds(lambda: F.linear(x, head.weight, head.bias), repeats=3)
        return True, packed_s < plain_s


_SEED = torch.Generator().manual_seed(0)


def median_seconds(fn: Any, repeats: int = 5, warmups: int = 1) -> float:
    """The median wall time of ``fn`` over ``repeats`` calls, after ``warmups`` calls."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]
