"""One forward of the model over rows of the executor's ``SlotCache``.

Every forward the engine runs on a request's row goes through ``Runner.run``: each row
feeds some tokens at given positions (a prefill, a cached prefix's continuation, a repair
pass's scattered positions, a decoding step); their KV is written at those positions and
each token attends to its row's positions up to its own. Rows feeding fewer tokens than
others are padded on the left (pads write to the scratch column and see position 0), so
every row's last real token is the forward's last query.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from kvboost_rag.core.generation.compiled import CHECK_KEYS, CompiledStep
from kvboost_rag.core.generation.slots import SlotCache, Write
from kvboost_rag.core.model import attention_choice, linears
from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.attention import KEYWORD, Forward, runs_sdpa, steered
from kvboost_rag.core.model.measurements import FORGETFUL, Measurements
from kvboost_rag.core.model.packed import PackedHead


class Runner:
    """Not thread-safe: the executor's thread runs every forward."""

    def __init__(self, model: Any, support: ModelSupport, slots: SlotCache) -> None:
        self.model = model
        self.support = support
        self.slots = slots
        self.windows = support.windows
        self.head = PackedHead(model)
        self.ways = linears.NONE  # row count -> the decoder's linear way (``measure``)
        # whether steps take ``few_query_attention`` (``prepare`` measures it)
        self.few = model.dtype in attention_choice.UNTIMED
        self.compiled = CompiledStep(model, support, slots)
        self.forwards = 0
        self.tokens = 0  # real tokens fed, pads excluded

    def run_rows(
        self,
        rows: Sequence[int],
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        keep: int = 1,
        packed: Sequence[bool | None] = (False,),
        compiled: bool = False,
    ) -> torch.Tensor:
        """Feed ``tokens[i]`` at ``positions[i]`` (ascending) to row ``rows[i]``; float32
        logits ``[rows, keep, vocab]`` after the last ``keep`` tokens of each row.
        ``packed``: the rows' requests' ``packed_head`` (``_packs`` decides);
        ``compiled``: whether every row's request lets the step take the
        compiled forward (``compiled.py``: row 0 alone, one token at its end)."""
        if compiled and self._compiles(rows, tokens, positions):
            logits = self.compiled.run(tokens[0][0], positions[0][0])
            if logits is not None:
                self.slots.lengths[0] = positions[0][0] + 1
                self.forwards += 1
                self.tokens += 1
                return logits
        width = max(p[-1] for p in positions) + 1
        self.slots.reserve(max(rows) + 1, width)
        contiguous = list(rows) == list(range(rows[0], rows[0] + len(rows)))
        index = (
            slice(rows[0], rows[0] + len(rows))
            if contiguous
            else torch.tensor(list(rows), device=self.model.device)
        )
        write, ids, position_ids, mask = self._layout(index, rows[0], tokens, positions, width)
        packed_head = self._packs(packed)
        inputs = {"input_ids": ids, "position_ids": position_ids, "attention_mask": mask}
        if steered(self.model):  # one sequence at its end may split attention there
            past = write.past if write.columns is None else None
            inputs[KEYWORD] = Forward(past, self.windows, rows=True, few=self.few)
        with self.slots.forward(write) as cache:
            inputs |= {"cache": cache, "use_cache": True}
            if packed_head:
                logits = self.head.logits(keep, **inputs)
            else:
                logits = self.model(**inputs, logits_to_keep=keep).logits
        for row, row_positions in zip(rows, positions):
            self.slots.lengths[row] = max(self.slots.lengths[row], row_positions[-1] + 1)
        self.forwards += 1
        self.tokens += sum(map(len, tokens))
        return logits[:, -keep:].float()

    def _compiles(
        self,
        rows: Sequence[int],
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
    ) -> bool:
        """Whether a forward is one the compiled step takes: row 0 alone, one token at its
        end, within the buffers' columns (the eager forward grows them)."""
        if not self.compiled.usable or list(rows) != [0] or len(tokens[0]) != 1:
            return False
        position, buffers = positions[0][0], self.slots.slot_layers[0].buffers
        columns = 0 if buffers is None else buffers[0].shape[2]  # the last: scratch
        return position == self.slots.lengths[0] and position + 1 < columns

    def warm_up(
        self,
        row: int,
        packed: bool | None,
        packed_linears: bool,
        measurements: Measurements = FORGETFUL,
    ) -> None:
        """Pay the first forward's one-time costs before any request does: ``prepare``,
        then ``first_use`` in free row ``row``."""
        self.prepare(packed, packed_linears, measurements)
        self.first_use(row, packed)

    def prepare(
        self, packed: bool | None, packed_linears: bool, measurements: Measurements
    ) -> None:
        """What steers the forwards: the way the decoder's linear layers take for each row
        count (``measure``, packing them only if ``packed_linears``), the attention form of
        the decoding steps (``attention_choice``) and the packed head's check (unless
        ``packed`` is False), each recalled from ``measurements`` where this machine
        measured the same before, else measured and kept there."""
        self.measure(packed_linears, measurements)
        self.few = attention_choice.few_queries(self.model, self.support.attention, measurements)
        if packed is not False:
            self.head.prepare(measurements)

    def first_use(self, row: int, packed: bool | None) -> None:
        """The kernels a prefill, a cached prefix's continuation and a decoding step take,
        run once in free row ``row`` (left empty). Measured on SmolLM2-135M (fp32, 2-core
        AVX2 EPYC): the first request after a new engine took its first token 1.2 s later
        than the next ones (0.85-0.95 s of it the head's check), which ``generate`` never
        pays. Safe to drop midway (``yielding.Preempted``) and run again; nothing to do
        once a request's forwards ran."""
        forwards, fed = self.forwards, self.tokens
        if forwards:
            return  # a request came first and paid them
        vocab = int(self.model.config.vocab_size)
        ids = [i % vocab for i in range(1, 9)]
        try:
            with torch.inference_mode():
                for fed_ids, at in ((ids, range(8)), (ids, range(8, 16)), (ids[:1], [16])):
                    self.run_rows([row], [fed_ids], [at], 1, [packed])
        finally:
            self.slots.lengths[row] = 0
            self.forwards, self.tokens = forwards, fed

    def compile_step(self, row: int, measured: bool) -> None:
        """Compile the one-row step (``CompiledStep.prepare``) on row 0, checked and timed
        against the eager step over ``CHECK_KEYS`` keys (``measured``: kept only if
        faster), when row ``row`` is 0 and free; otherwise it stays off."""
        if self.compiled.state != "off" or row != 0:
            return
        vocab = int(self.model.config.vocab_size)
        ids = [(7 * i + 3) % vocab for i in range(CHECK_KEYS)]

        def eager(token: int, position: int) -> torch.Tensor:
            # the step a request takes: continuing the row, the head packed where it pays
            self.slots.lengths[0] = position
            return self.run_rows([0], [[token]], [[position]], packed=[None])

        forwards, fed = self.forwards, self.tokens
        with torch.inference_mode():
            self.run_rows([0], [ids], [range(CHECK_KEYS)])
            self.compiled.prepare(eager, measured)
        self.slots.lengths[0] = 0
        self.forwards, self.tokens = forwards, fed

    def measure(self, packed_linears: bool, measurements: Measurements = FORGETFUL) -> None:
        """The ways the decoder's linear layers take (``linears.measure``, or what
        ``measurements`` kept for the same shapes), packing them where the fastest way is
        packed and ``packed_linears`` allows it."""
        key = _linears_key(self.model, packed_linears)
        kept = None if key is None else _ways(measurements.recall("linears", key))
        if kept is not None:
            self.ways = linears.adopt(self.model, kept, packed_linears)
            return
        self.ways = linears.measure(self.model, packed_linears)
        if key is not None:
            measurements.keep("linears", key, list(self.ways))

    def _packs(self, wishes: Sequence[bool | None]) -> bool:
        """Whether a forward applies the packed head: no row's engine against it, and the
        split right here (and measured faster, unless a row's engine asked for it)."""
        if False in wishes:
            return False
        return self.head.usable(measured=True not in wishes)

    def _layout(
        self,
        rows: slice | torch.Tensor,
        first: int,
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        width: int,
    ) -> tuple[Write, torch.Tensor, torch.Tensor, Any]:
        device = self.model.device
        past = self.slots.lengths[first]
        if len(tokens) == 1 and list(positions[0]) == list(range(past, past + len(tokens[0]))):
            # One row continuing at its end: transformers builds its own (causal, windowed)
            # mask from the positions, or none at all, and attention takes its fast path.
            ids = torch.tensor([list(tokens[0])], device=device)
            position_ids = torch.tensor([list(positions[0])], device=device)
            return Write(rows, None, past, width, past), ids, position_ids, None
        q = max(map(len, tokens))
        ids = torch.zeros((len(tokens), q), dtype=torch.long)
        seen = torch.zeros((len(tokens), q), dtype=torch.long)  # pads see position 0
        columns = torch.full((len(tokens), q), self.slots.scratch, dtype=torch.long)
        for i, (row_tokens, row_positions) in enumerate(zip(tokens, positions)):
            n = len(row_tokens)
            ids[i, q - n :] = torch.tensor(list(row_tokens))
            seen[i, q - n :] = columns[i, q - n :] = torch.tensor(list(row_positions))
        seen = seen.to(device)
        write = Write(rows, columns.to(device), 0, width, past)
        return write, ids.to(device), seen, self._mask(seen, width)

    def _mask(self, seen: torch.Tensor, width: int) -> Any:
        """Query ``j`` of row ``b`` sees the row's columns up to ``seen[b, j]`` (within a
        sliding window, for windowed layers), as the model's forward takes masks."""
        columns = torch.arange(width, device=seen.device)[None, None, :]
        causal = columns <= seen[:, :, None]
        boolean = runs_sdpa(self.model)

        def build(window: int | None) -> torch.Tensor:
            allowed = causal if window is None else causal & (columns > seen[:, :, None] - window)
            if boolean:
                return allowed[:, None]
            mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=seen.device)
            return mask.masked_fill_(~allowed, torch.finfo(self.model.dtype).min)[:, None]

        return self.support.attention_masks(build)


def _ways(kept: Any) -> linears.Ways | None:
    """``linears.Ways`` from its JSON form (row counts as strings); None for another form."""
    try:
        fastest, unpacked = ({int(n): str(w) for n, w in ways.items()} for ways in kept)
    except (TypeError, ValueError, AttributeError):
        return None
    known = {linears.TRANSPOSED, linears.PACKED}
    if not set(fastest.values()) | set(unpacked.values()) <= known:
        return None
    return linears.Ways(fastest, unpacked)


def _linears_key(model: Any, packed: bool) -> dict[str, Any] | None:
    """What ``linears.measure``'s answer depends on besides the machine: the decoder's
    weight shapes and dtype, what it measures; None where it times nothing (a small
    decoder, no linear layers, another dtype)."""
    layers = linears.install(model)
    total = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    if total < linears.MEASURED_BYTES or model.dtype not in (torch.float32, torch.bfloat16):
        return None
    shapes = Counter((la.out_features, la.in_features, la.bias is not None) for la in layers)
    return {
        "dtype": str(model.dtype),
        "linears": sorted(shapes.items()),
        "fused": sum(layer.fused is not None for layer in layers),
        "measure": [
            *(linears.CANDIDATES, linears.STREAMED, linears.STREAMED_BYTES, linears.REPEATS),
            *(packed, linears.PACKED_BYTES),
        ],
    }
