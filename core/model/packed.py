"""Linear layers on weights prepacked for oneDNN, in the engine's few-token forwards (CPU).

A batched decoding step feeds each row one token, so every linear layer multiplies a
weight by a handful of rows. There ``torch.nn.functional.linear`` leaves much of the speed
on the table, and a oneDNN matmul on a weight reordered once into its blocked layout does
not. Measured on a 2-core AMD EPYC (AVX2, fp32), one call on SmolLM2-135M's shapes, in
microseconds (``kvboost-rag bench step`` times the whole model's layers both ways):

| rows | 576->1536 F.linear / packed | 1536->576 | lm_head 576->49152 |
|---|---|---|---|
| 1 | 86 / 89 | 81 / 112 | 12,434 / 8,555 |
| 2 | 190 / 106 | 136 / 99 | 22,245 / 6,701 |
| 8 | 283 / 149 | 375 / 197 | 31,499 / 11,411 |
| 32 | 517 / 444 | 523 / 453 | 38,652 / 17,331 |
| 64 | 1,019 / 1,286 | 1,202 / 1,353 | 60,148 / 30,551 |

So a linear call with at most ``MAX_ROWS`` rows takes the packed weight; larger ones (a
prefill's) stay ``F.linear``. It is what inductor's freezing pass does to linear weights
(``kvboost-rag bench step``: compiled MLPs 37 ms against 61 eager at 8 rows), without a
25-30 s compile per model and shape.

How: inside ``packed_linears`` (the executor's forwards only, never a user's own call on the
model), a ``TorchFunctionMode`` on the calling thread sends ``F.linear`` calls whose weight
was packed to ``torch.ops.mkldnn._linear_pointwise``. The model is not modified. The cost is
one Python dispatch per torch call in the forward, a few ms per step, so the executor
uses it for forwards of two or more tokens (a one-token step gains about as much on the
lm_head as the dispatch costs).

Kept correct: a weight changed after packing (an in-place update bumps its version, a
reassigned ``.data`` moves its storage) is packed again before use; the packed result is
compared with ``F.linear`` when packing (``check``), and a machine where the packed op is
missing or fails keeps ``F.linear``, and so, by default, does one where it is not faster
at 8 rows on the model's widest layer (``PackedWeights.usable``).
The packed copies cost one more copy of the linear weights in memory.

The two ops are torch's private ones (inductor's lowering calls them); they exist from
torch 2.1 and are checked on first use.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MAX_ROWS = 32  # packed only up to here: at 64 rows F.linear measured faster
PACK_ROWS = 8  # the row count oneDNN is told to expect when reordering
# bf16 packs only where oneDNN computes it natively; fp16 never on CPU
_DTYPES = (torch.float32, torch.bfloat16)


def supported(model: Any) -> bool:
    """Whether ``model``'s linear layers can take packed weights here: on a CPU with
    oneDNN, in fp32 (or bf16 where oneDNN computes it natively), torch's ops present."""
    if torch.device(model.device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if model.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(model.dtype == torch.float32)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> Any:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeights:
    """The packed copies of a model's ``nn.Linear`` weights, made on first use.

    Not thread-safe: the executor's thread (one at a time) is its only user."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._packed: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}
        # whether packing is possible and right here / also faster (None: not tried yet)
        self._correct: bool | None = None if supported(model) else False
        self._faster = False
        self.seconds = 0.0  # spent packing and checking

    def usable(self, measured: bool = True) -> bool:
        """Packs every linear weight on the first call. False when packing is unsupported
        here, fails or gives another result (nothing is kept then), and, with ``measured``
        (the default choice), when it was not faster on the model's widest layer."""
        if self._correct is None:
            start = time.perf_counter()
            try:
                self._correct, self._faster = self._pack_all()
            except RuntimeError:  # the op is missing or rejects this layout
                self._correct = False
            if not self._correct:
                self._packed.clear()
            self.seconds += time.perf_counter() - start
        return self._correct and (self._faster or not measured)

    def _pack_all(self) -> tuple[bool, bool]:
        linears = [m for m in self.model.modules() if type(m) is torch.nn.Linear]
        if not linears:
            return False, False
        with torch.inference_mode():
            for module in linears:
                self._store(module.weight)
            widest = max(linears, key=lambda m: m.weight.numel())
            return check(widest.weight, self._packed[id(widest.weight)][3], widest.bias)

    def _store(self, weight: torch.Tensor) -> torch.Tensor:
        packed = _pack(weight)
        self._packed[id(weight)] = (weight, weight._version, weight.data_ptr(), packed)
        return packed

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight`` (packed anew if the weight changed), or None if it
        is not one of the model's linear weights."""
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] is not weight:
            return None
        if entry[1] != weight._version or entry[2] != weight.data_ptr():
            with torch.inference_mode():
                return self._store(weight)
        return entry[3]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside, on this thread, linear calls of at most ``MAX_ROWS`` rows on the model's
        weights run packed (call only once ``usable``)."""
        with _Mode(self):
            yield


def check(
    weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> tuple[bool, bool]:
    """Whether the packed weight gives ``F.linear``'s result (up to summation order), and
    whether it is faster at ``PACK_ROWS`` rows, on random input."""
    x = torch.randn(PACK_ROWS, weight.shape[1], dtype=weight.dtype, generator=_GENERATOR)
    expected, got = F.linear(x, weight, bias), _packed_linear(x, packed, bias)
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    scale = expected.abs().max().item() or 1.0
    if (got - expected).abs().max().item() > tolerance * scale:
        return False, False
    packed_s = _time(lambda: _packed_linear(x, packed, bias))
    return True, packed_s < _time(lambda: F.linear(x, weight, bias))


_GENERATOR = torch.Generator().manual_seed(0)


def _time(fn: Any, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


class _Mode(TorchFunctionMode):
    def __init__(self, weights: PackedWeights) -> None:
        super().__init__()
        self.weights = weights

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() >= 2 and x.numel() <= MAX_ROWS * x.shape[-1] and x.dtype == weight.dtype:
                packed = self.weights.get(weight)
                if packed is not None:
                    return _packed_linear(x, packed, bias)
        return func(*args, **kwargs)
