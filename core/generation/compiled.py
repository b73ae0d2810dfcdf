"""A one-row decoding step compiled by inductor, taken where it measures faster.

At one row a CPU decoding step is mostly per-operator overhead: SmolLM2-135M's one-token
step over 900 keys took 38-50 ms in the engine's eager forward and 24-30 ms compiled
(bf16, 2-core AVX-512 EPYC, ``python -m benchmarks.decode.step``, four runs). At 8 rows compiling
lost (91-114 against 58-108 ms), and verifying a draft feeds several tokens, so only a
forward of row 0 alone feeding one token at its end takes the compiled step.

The compiled forward is transformers' own, over a cache whose layers are views of row 0 of
the ``SlotCache`` buffers (so its writes land in the engine's KV), with the row's length
given as a 4D mask and the buffers' capacity marked dynamic: one compile serves the row as
its buffers grow (measured: 1280 then 2048 columns, no recompile). Attention is matrix
products in the model's dtype, as transformers' eager attention computes it
(``attention.few_query_attention``; the compiled SDPA kernel measured 34 against 24 ms with
eager attention), and inductor freezes the weights (it prepacks them for oneDNN: about one
more copy of the decoder's linear weights in memory) and emits a C++ wrapper.

Compiling takes a minute or two per model (70-100 s for SmolLM2-135M here; inductor caches
its output on disk, so a later process on the same model is quicker), so it is opt-in
(``KVBoostConfig.compiled_step``) and happens at warm-up, on the executor's thread. The
warm-up then checks the compiled step's logits against the eager step's and times both
over ``CHECK_KEYS`` keys; the engine keeps the eager step, with the reason, when compiling
raised (no C++ compiler, an operator inductor lacks), the logits differ, or it is not
faster. Models with sliding-window layers and models off the CPU keep the eager step too.
A step that would need a recompile (a shape the compile did not cover) runs eagerly, and
the engine stops taking the compiled step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvboost_rag.core.generation.slots import SlotCache
from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.attention import COMPILED, KEYWORD

# Keys the warm-up's check and timing run over: long enough that attention counts as in a
# RAG prompt (at 2048 keys a float32 step was level with the eager one, at 900 faster). At
# Qwen2.5-Coder-1.5B (bf16) the compiled step took 302 / 154 / 309 ms over 512 / 900 / 2048
# keys against the eager step's 237 / 191 / 264 (``scripts/step_constants.py --parts
# compiled``, docs/bench/constants-*): it does not pay reliably there, and the check at 512
# keys (``compiled_step="measured"``) keeps the eager step. Kept.
CHECK_KEYS = 512
# The compiled step's logits may differ from the eager step's by rounding only: at most
# this fraction of the logits' largest magnitude (float32 measured ~1e-6 of it on the tiny
# test models; bfloat16 up to ~3%: 0.25-0.7 on SmolLM2's logits over 900 keys).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}
HALF_TOLERANCE = 0.05
REPEATS = 7  # timed steps of each kind, interleaved


class RowLayer(CacheLayerMixin):
    """One decoder layer's KV for the compiled step: views of row 0 of a ``SlotLayer``'s
    buffers, written at ``position`` (a one-element tensor shared by every layer)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, position: torch.Tensor) -> None:
        super().__init__()
        self.position = position
        self.is_initialized = True

    def bind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("a RowLayer views the slot cache's buffers: bind it first")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        self.keys.index_copy_(2, self.position, key_states)
        self.values.index_copy_(2, self.position, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        assert self.keys is not None
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return int(self.position)

    def get_max_length(self) -> int:
        assert self.keys is not None
        return int(self.keys.shape[2])


class CompiledStep:
    """Row 0's one-token decoding step, compiled. Not thread-safe: the executor's thread
    runs it. ``state``: ``"off"`` (never asked for), ``"on"`` or why the eager step runs."""

    def __init__(self, model: Any, support: ModelSupport, slots: SlotCache) -> None:
        self.model = model
        self.support = support
        self.slots = slots
        self.state = "off"
        self.steps = 0  # steps taken compiled
        self.compile_seconds = 0.0
        self.ms: tuple[float, float] | None = None  # (compiled, eager) at the warm-up's check
        self._position = torch.zeros(1, dtype=torch.long, device=model.device)
        self._layers = [RowLayer(self._position) for _ in support.layer_types]
        self._cache = Cache(layers=self._layers)  # type: ignore[arg-type]
        self._bound: list[torch.Tensor | None] = [None] * len(self._layers)
        self._forward: Callable[..., Any] | None = None

    @property
    def usable(self) -> bool:
        return self.state == "on"

    def unavailable(self) -> str | None:
        """Why this model cannot take a compiled step; None where it can try."""
        if torch.device(self.model.device).type != "cpu":
            device = self.model.device
            return f"eager: the compiled step is built and measured for CPUs, not {device}"
        if self.support.sliding_window is not None:
            return "eager: the model has sliding-window layers (not the slot rows' layout)"
        return None

    def prepare(self, eager: Callable[[int, int], torch.Tensor], measured: bool) -> None:
        """Compile, check and time the step on row 0, which the caller filled to
        ``CHECK_KEYS`` positions; ``eager(token, position)`` runs the eager step there.
        ``measured``: keep it only if it was faster. Leaves ``state`` "on" or the reason
        it is not."""
        if self.state == "off":
            self.state = self.unavailable() or self._check(eager, measured)

    def _check(self, eager: Callable[[int, int], torch.Tensor], measured: bool) -> str:
        import torch._inductor.config as inductor

        token = int(self.model.config.vocab_size) // 2
        want = eager(token, CHECK_KEYS)
        self._forward = torch.compile(self.model.forward, dynamic=None)
        start = time.perf_counter()
        try:
            with inductor.patch(freezing=True, cpp_wrapper=True):
                got = self._call(token, CHECK_KEYS, mark=True)
        except Exception as error:  # no C++ compiler, an operator inductor cannot lower
            self._forward = None
            return f"eager: compiling failed ({_said(error)})"
        self.compile_seconds = time.perf_counter() - start
        bound = TOLERANCE.get(self.model.dtype, HALF_TOLERANCE) * max(1.0, float(want.abs().max()))
        diff = float((got - want).abs().max())
        if not diff <= bound:
            return f"eager: its logits differ from the eager step's by {diff:.3g} (> {bound:.3g})"
        self.ms = self._time(
            lambda: self._call(token, CHECK_KEYS), lambda: eager(token, CHECK_KEYS)
        )
        if measured and self.ms[0] >= self.ms[1]:
            return "eager: the compiled step was not faster ({:.1f} against {:.1f} ms)".format(
                *self.ms
            )
        return "on"

    def run(self, token: int, position: int) -> torch.Tensor | None:
        """Feed ``token`` at ``position`` of row 0 (its end); float32 logits ``[1, 1, vocab]``,
        or None where the compiled step cannot take it (the caller runs the eager one)."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                logits = self._call(token, position)
        except Exception as error:  # a shape or guard the compile did not cover
            self.state = f"eager: a step needed a recompile ({_said(error)})"
            return None
        self.steps += 1
        return logits

    def _call(self, token: int, position: int, mark: bool = False) -> torch.Tensor:
        assert self._forward is not None
        self._bind(mark)
        capacity = self._layers[0].get_max_length()
        mask = torch.zeros((1, 1, 1, capacity), dtype=self.model.dtype, device=self.model.device)
        mask[..., position + 1 :] = torch.finfo(self.model.dtype).min
        if mark:
            torch._dynamo.mark_dynamic(mask, 3)
        self._position.fill_(position)
        inputs = {
            "input_ids": torch.tensor([[token]], device=self.model.device),
            "position_ids": torch.tensor([[position]], device=self.model.device),
            "attention_mask": mask,
            "cache": self._cache,
            "use_cache": True,
            KEYWORD: COMPILED,
        }
        logits = self._forward(**inputs).logits
        return logits[:, -1:].float()  # type: ignore[no-any-return]

    def _bind(self, mark: bool) -> None:
        """Point each layer at row 0 of its slot layer's buffers (new tensors after they grew)."""
        for i, (layer, slot) in enumerate(zip(self._layers, self.slots.slot_layers)):
            assert slot.buffers is not None, "row 0 holds no KV yet"
            if self._bound[i] is slot.buffers[0] and not mark:
                continue
            keys, values = slot.buffers[0][:1], slot.buffers[1][:1]
            if mark:
                torch._dynamo.mark_dynamic(keys, 2)
                torch._dynamo.mark_dynamic(values, 2)
            layer.bind(keys, values)
            self._bound[i] = slot.buffers[0]

    @staticmethod
    def _time(compiled: Callable[[], object], eager: Callable[[], object]) -> tuple[float, float]:
        """Median ms of each, their calls interleaved (the machine's drift shared)."""
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(REPEATS):
            for fn, out in ((compiled, times[0]), (eager, times[1])):
                start = time.perf_counter()
                fn()
                out.append((time.perf_counter() - start) * 1e3)
        return sorted(times[0])[REPEATS // 2], sorted(times[1])[REPEATS // 2]


def _said(error: BaseException) -> str:
    """An exception's type and first line, for a state (exceptions may span pages)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
