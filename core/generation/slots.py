"""The executor's KV: one buffer per layer holding every request's row, written in place.

Each running or building request owns a row of ``[rows, kv_heads, capacity, head_dim]``
buffers; position ``p`` of its prompt or answer is column ``p`` of its row. A forward
writes its new tokens' keys and values at their own positions (``SlotCache.forward``) and
attends to the row up to each token's position, so one primitive serves a plain prefill,
the continuation of a cached prefix, a repair pass (scattered positions: the fresh KV
replaces the reused KV in place, and the causal mask by position gives exactly the
repair's visibility), a decoding step and a batch of any of these. Nothing is copied per
step: ``DynamicLayer`` concatenates the whole cache on every token.

Rows that take part in one forward are a contiguous range, so the model reads views of
the buffers. Columns past a row's length hold stale but finite values that no query can
see (the mask is causal by position).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvboost_rag.core.model.kv import LayerKV

ROOM = 256  # capacity grows in steps of this many positions (then doubles)


def _room(columns: int) -> int:
    """``columns`` rounded up to whole steps of ``ROOM``."""
    return -(-columns // ROOM) * ROOM


@dataclass(frozen=True)
class Write:
    """Where one forward's new tokens go."""

    rows: slice | torch.Tensor  # the rows taking part, in batch order (a slice: views; an
    # index tensor, for rows that are not contiguous: the attention reads a gathered copy)
    columns: torch.Tensor | None  # [rows, tokens] column of each new token; None: contiguous
    start: int  # with ``columns`` None: the first column (every row the same)
    width: int  # columns the attention reads after the write
    past: int  # what ``get_seq_length`` reports (for transformers' own masks, batch of one)


class SlotLayer(CacheLayerMixin):
    """One decoder layer of a ``SlotCache`` (``keys``/``values``: the last forward's views)."""

    is_sliding = False  # every layer keeps every position; the model's masks do windowing
    is_compileable = False
    is_croppable = True

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self._cache = cache
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._cache.measured(key_states, value_states)
        shape = (self._cache.row_capacity, key_states.shape[1], self._cache.capacity)
        self.buffers = tuple(  # type: ignore[assignment]
            t.new_zeros((*shape, t.shape[-1])) for t in (key_states, value_states)
        )
        self.is_initialized = True
        self._cache.held()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        write = self._cache.current
        assert write is not None, "a SlotCache is written only inside SlotCache.forward"
        self.ensure(key_states, value_states)
        assert self.buffers is not None
        out = []
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            if isinstance(write.rows, slice):
                rows = buffer[write.rows]
                if write.columns is None:
                    rows[:, :, write.start : write.start + states.shape[-2]] = states
                else:
                    index = torch.arange(rows.shape[0], device=rows.device)[:, None]
                    rows[index, :, write.columns] = states.transpose(1, 2)
                out.append(rows[:, :, : write.width])
            else:
                columns = write.columns
                if columns is None:
                    start = write.start
                    columns = torch.arange(start, start + states.shape[-2], device=buffer.device)
                    columns = columns.expand(len(write.rows), -1)
                buffer[write.rows[:, None], :, columns] = states.transpose(1, 2)
                out.append(buffer.index_select(0, write.rows)[:, :, : write.width])
        self.keys, self.values = out
        return out[0], out[1]

    def ensure(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Buffers shaped for ``keys``/``values`` with the cache's row and column capacity."""
        if self.buffers is None:
            self.lazy_initialization(keys, values)
            return
        rows, capacity = self._cache.row_capacity, self._cache.capacity
        old_rows, _, old_capacity, _ = self.buffers[0].shape
        if rows > old_rows or capacity > old_capacity:
            grown = []
            for old in self.buffers:
                new = old.new_zeros((rows, old.shape[1], capacity, old.shape[3]))
                new[:old_rows, :, :old_capacity] = old
                grown.append(new)
            self.buffers = (grown[0], grown[1])
            self._cache.held()

    def get_seq_length(self) -> int:
        write = self._cache.current
        return 0 if write is None else write.past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.buffers = None
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Row lengths live in the ``SlotCache``; ``SlotCache.crop`` shortens a row."""
        raise NotImplementedError("crop rows with SlotCache.crop(row, length)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a SlotCache holds one row per request; beams are not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("rows move with SlotCache.move_row")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a SlotCache holds one row per request; beams are not supported")


class SlotCache(Cache):
    """Rows of KV for the requests one executor runs. Not thread-safe: the executor's thread
    is its only user. ``lengths[row]``: positions of the row that hold valid KV."""

    def __init__(self, num_layers: int, position_bytes: int = 0) -> None:
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])
        self.row_capacity = 1
        self.capacity = ROOM
        self.lengths: list[int] = []
        self.current: Write | None = None
        # A position's KV over every layer, in bytes: estimated from the model's config,
        # then what the buffers hold (``lazy_initialization``).
        self.position_bytes = position_bytes
        self.budget: int | None = None  # the buffers never grow past it (``reserve``)
        self.peak_bytes = 0  # the most the buffers held

    def bytes_for(self, rows: int, columns: int) -> int:
        """The buffers' bytes with room for ``rows`` rows of ``columns`` positions."""
        return rows * _room(columns + 1) * self.position_bytes

    def measured(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A layer's first keys and values: what a position costs over every layer (in
        place of the estimate from the model's config)."""
        per_layer = sum(t.shape[1] * t.shape[-1] * t.element_size() for t in (keys, values))
        self.position_bytes = per_layer * len(self.layers)

    def held(self) -> int:
        """The buffers' bytes now; the peak is kept in ``peak_bytes``."""
        held = sum(
            b.numel() * b.element_size() for layer in self.slot_layers for b in layer.buffers or ()
        )
        self.peak_bytes = max(self.peak_bytes, held)
        return held

    @property
    def slot_layers(self) -> list[SlotLayer]:
        return self.layers  # type: ignore[return-value]

    def reserve(self, rows: int, columns: int) -> None:
        """Room for ``rows`` rows of ``columns`` positions (one more: see ``SCRATCH``)."""
        while len(self.lengths) < rows:
            self.lengths.append(0)
        if rows > self.row_capacity:  # doubled, within the budget
            self.row_capacity = max(rows, min(2 * self.row_capacity, self._fits(self.capacity)))
        need = columns + 1
        if need > self.capacity:  # grown by half at least: a decoding row does not regrow
            grown = _room(max(need, self.capacity * 3 // 2))
            self.capacity = max(_room(need), min(grown, self._fits(self.row_capacity, ROOM)))

    def _fits(self, size: int, step: int = 1) -> int:
        """How many rows of ``size`` columns (or columns of ``size`` rows, in steps of
        ``step``) the budget holds; unbounded without one."""
        if self.budget is None or not self.position_bytes:
            return sys.maxsize
        return self.budget // (size * self.position_bytes) // step * step

    @property
    def scratch(self) -> int:
        """A column no row's data reaches, where padded queries write (and nobody reads)."""
        return self.capacity - 1

    @contextmanager
    def forward(self, write: Write) -> Iterator[SlotCache]:
        """The cache as one forward over ``write.rows`` sees it."""
        self.current = write
        try:
            yield self
        finally:
            self.current = None

    def write_kv(self, row: int, start: int, kv: LayerKV) -> None:
        """Copy ``kv`` (per layer ``[1, heads, n, dim]``) into ``row`` at ``start``."""
        n = kv[0][0].shape[-2]
        self.reserve(row + 1, start + n)
        for layer, (keys, values) in zip(self.slot_layers, kv):
            layer.ensure(keys, values)
            assert layer.buffers is not None
            layer.buffers[0][row, :, start : start + n] = keys[0]
            layer.buffers[1][row, :, start : start + n] = values[0]
        self.lengths[row] = max(self.lengths[row], start + n)

    def zero(self, row: int, start: int, end: int) -> None:
        """Zero positions [start, end) of ``row`` (they may hold an earlier request's KV)."""
        self.reserve(row + 1, end)
        for layer in self.slot_layers:
            if layer.buffers is not None:
                layer.ensure(*layer.buffers)
                for buffer in layer.buffers:
                    buffer[row, :, start:end] = 0

    def views(self, row: int, start: int, end: int) -> LayerKV:
        """Positions [start, end) of ``row`` as ``[1, heads, n, dim]`` views (no copy)."""
        out = []
        for layer in self.slot_layers:
            assert layer.buffers is not None, "the row holds no KV yet"
            keys, values = layer.buffers
            out.append((keys[row : row + 1, :, start:end], values[row : row + 1, :, start:end]))
        return out

    def read(self, row: int, start: int, end: int) -> LayerKV:
        """A copy of positions [start, end) of ``row`` (kept after the row is reused)."""
        return [(k.clone(), v.clone()) for k, v in self.views(row, start, end)]

    def move_row(self, source: int, target: int) -> None:
        """Move ``source``'s KV into ``target`` (whose KV is dropped). A row the buffers
        never grew to (its request failed before any KV was written) holds nothing."""
        if source == target:
            return
        length = self.lengths[source]
        for layer in self.slot_layers:
            if layer.buffers is not None and max(source, target) < layer.buffers[0].shape[0]:
                for buffer in layer.buffers:
                    buffer[target, :, :length] = buffer[source, :, :length]
        self.lengths[target], self.lengths[source] = length, 0

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange the KV (and lengths) of rows ``a`` and ``b``."""
        if a == b:
            return
        for layer in self.slot_layers:
            if layer.buffers is not None and max(a, b) < layer.buffers[0].shape[0]:
                for buffer in layer.buffers:
                    buffer[[a, b]] = buffer[[b, a]]
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def crop(self, row: int, length: int) -> None:  # type: ignore[override]
        """Keep the first ``length`` positions of ``row`` (speculation's rollback)."""
        assert 0 <= length <= self.lengths[row]
        self.lengths[row] = length

    def clear(self) -> None:
        """Drop every row and the buffers (the executor is idle)."""
        for layer in self.slot_layers:
            layer.reset()
        self.lengths, self.row_capacity, self.capacity = [], 1, ROOM


def position_bytes(model: Any) -> int:
    """A position's KV over every layer, in bytes, from the model's config (0: unknown)."""
    config = model.config.get_text_config()
    try:
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * config.num_hidden_layers * heads * dim * model.dtype.itemsize
    except (AttributeError, TypeError):
        return 0


class Row:
    """A request's row, as its owner's context build sees it (``RowKV``)."""

    def __init__(self, slots: SlotCache, index: int) -> None:
        self._slots = slots
        self.index = index

    def write(self, start: int, kv: LayerKV) -> None:
        self._slots.write_kv(self.index, start, kv)

    def zero(self, start: int, end: int) -> None:
        self._slots.zero(self.index, start, end)

    def views(self, start: int, end: int) -> LayerKV:
        return self._slots.views(self.index, start, end)

    def copy(self, start: int, end: int) -> LayerKV:
        return self._slots.read(self.index, start, end)

    @property
    def length(self) -> int:
        return self._slots.lengths[self.index]
