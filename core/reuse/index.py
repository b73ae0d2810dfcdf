"""The passages an engine knows, found in any prompt's tokens without markers.

Every passage the passage cache stores (warmed, encoded for a prompt, or deferred) is
indexed by two windows of ``WINDOW`` of its own tokens, starting at its tokens 1 and
``HEAD_SLACK`` (its very first tokens may merge with the text before it in a prompt). A
lookup hashes every window of the prompt at once (a rolling polynomial over the token ids,
in numpy), looks each hash up in one dict, and places each candidate by comparing its
tokens with the prompt's, token by token, outward from the window: a hash collision or a
near-duplicate passage never lends KV to tokens it does not hold. Overlapping candidates
keep the longer run (a passage that is a prefix of another yields to the other where both
fit, and either is right: KV is causal).

The index holds token ids only (no KV): ``max_passages`` of them, least recently found
dropped first. A passage whose KV every tier has since dropped stays known, so a prompt
holding it still places it (a miss the engine encodes again, for the next prompt).

Passages other processes store are learnt from the tiers' catalogues (``known``): read
in full at first use, then what was added since, at most every ``REFRESH_SECONDS`` when a
prompt is looked up, so a server replica finds passages another replica warmed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvboost_rag.core.prompt.placing import HEAD_SLACK, Placed, run_at

WINDOW = 16  # tokens per indexed window: a passage needs WINDOW + HEAD_SLACK to be found
ANCHORS = (1, HEAD_SLACK)  # where in a passage its indexed windows start
MAX_PASSAGES = 200_000
REFRESH_SECONDS = 1.0  # a shared catalogue read (a round trip) per second at most
_CANDIDATES = 8  # passages kept per window hash (a shared boilerplate opening)

_POWERS = np.array([pow(1_000_003, WINDOW - 1 - j, 1 << 64) for j in range(WINDOW)], np.uint64)

HeadCheck = Callable[[Sequence[int], int, Sequence[int]], bool]


def window_hashes(tokens: np.ndarray) -> np.ndarray:
    """The hash of every ``WINDOW``-token window of ``tokens`` (uint64, wrapping)."""
    if len(tokens) < WINDOW:
        return np.empty(0, np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.uint64), WINDOW)
    with np.errstate(over="ignore"):
        return windows @ _POWERS


class PassageIndex:
    """Thread-safe: lookups run on callers' threads, additions on the executor's.

    ``known``: the passages other processes stored since its last call (the tiers'
    catalogues), read at first use and then at most every ``refresh_seconds``; ``record``:
    told of each passage new to the index (those catalogues' append).
    """

    def __init__(
        self,
        max_passages: int = MAX_PASSAGES,
        known: Callable[[], Iterable[Sequence[int]]] | None = None,
        record: Callable[[Sequence[int]], None] | None = None,
        refresh_seconds: float = REFRESH_SECONDS,
    ) -> None:
        self.max_passages = max_passages
        self._known, self._record = known, record
        self._refresh_seconds = refresh_seconds
        self._read_at: float | None = None  # when ``known`` was last read
        self._loading = threading.Lock()
        self._lock = threading.Lock()
        # Each passage's token ids as int32 bytes: its key and its tokens in one object.
        self._passages: OrderedDict[bytes, None] = OrderedDict()
        self._windows: dict[int, list[bytes]] = {}

    def __len__(self) -> int:
        self._load()
        return len(self._passages)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        self._load()
        return _key(tokens) in self._passages

    def _load(self, refresh: bool = True) -> None:
        """Index what other processes stored: all of it at first use (callers meanwhile
        wait), then what is new, when due and ``refresh`` (a caller finding it under way
        goes on). Additions do not refresh: they run on the executor's thread."""
        if self._known is None or not self._due() or (self._read_at is not None and not refresh):
            return
        if not self._loading.acquire(blocking=self._read_at is None):
            return
        try:
            if self._due():
                for tokens in self._known():
                    self._add(tokens, record=False)
                self._read_at = time.monotonic()
        finally:
            self._loading.release()

    def _due(self) -> bool:
        read_at = self._read_at
        return read_at is None or time.monotonic() - read_at >= self._refresh_seconds

    def add(self, tokens: Sequence[int]) -> bool:
        """Index a passage by its own tokens; False when too short to be found unmarked."""
        self._load(refresh=False)
        return self._add(tokens, record=True)

    def _add(self, tokens: Sequence[int], record: bool) -> bool:
        if len(tokens) < WINDOW + HEAD_SLACK:
            return False
        key = _key(tokens)
        if key in self._passages:  # most adds: one dict read, atomic
            with self._lock:
                self._passages.move_to_end(key)
            return True
        hashes = window_hashes(np.frombuffer(key, np.int32))
        with self._lock:
            if key in self._passages:
                return True
            self._passages[key] = None
            for anchor in ANCHORS:
                bucket = self._windows.setdefault(int(hashes[anchor]), [])
                if len(bucket) < _CANDIDATES:
                    bucket.append(key)
            while len(self._passages) > self.max_passages:
                self._drop(self._passages.popitem(last=False)[0])
        if record and self._record is not None:
            self._record(tokens)
        return True

    def find(
        self, tokens: Sequence[int], taken: Sequence[Placed] = (), head_ok: HeadCheck | None = None
    ) -> list[Placed]:
        """Known passages in ``tokens`` that overlap none of ``taken``, in order. A run that
        starts past a passage's first token needs ``head_ok(tokens before it, how many of
        the passage's tokens are missing, the passage)``: that the prompt spells them."""
        self._load()
        stream = np.asarray(tokens, dtype=np.int64)
        hashes = window_hashes(stream)
        windows = self._windows
        hits = [(i, windows[h]) for i, h in enumerate(hashes.tolist()) if h in windows]
        if not hits:
            return []
        chosen: list[Placed] = []
        seen: set[tuple[bytes, int]] = set()
        for i, candidates in hits:
            for key in list(candidates):
                own = np.frombuffer(key, np.int32)
                for anchor in ANCHORS:
                    offset = i - anchor
                    if (key, offset) in seen or offset + len(own) <= 0:
                        continue
                    seen.add((key, offset))
                    spot = _extend(stream, own, offset, i, head_ok)
                    if spot is not None:
                        _keep(chosen, spot, taken)
        with self._lock:
            for spot in chosen:
                key = _key(spot.tokens)
                if key in self._passages:
                    self._passages.move_to_end(key)
        return sorted(chosen, key=lambda p: p.start)

    def _drop(self, key: bytes) -> None:
        """Under ``_lock``."""
        hashes = window_hashes(np.frombuffer(key, np.int32))
        for anchor in ANCHORS:
            h = int(hashes[anchor])
            bucket = self._windows.get(h, [])
            if key in bucket:
                bucket.remove(key)
            if not bucket:
                self._windows.pop(h, None)


def _key(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


def _extend(
    stream: np.ndarray,
    own: np.ndarray,
    offset: int,
    at: int,
    head_ok: HeadCheck | None,
) -> Placed | None:
    """The run of ``stream`` through position ``at`` equal to ``own`` placed at
    ``offset``, grown token by token both ways; None when the window does not match (a
    hash collision) or the passage's head is missing."""
    first = at - offset
    if first < 0 or first >= len(own) or stream[at] != own[first]:
        return None
    end = run_at(stream, own, at, first)
    if end - at < WINDOW:
        return None
    start = at
    while start > 0 and start - offset > 0 and stream[start - 1] == own[start - offset - 1]:
        start -= 1
    missing = start - offset
    if missing > HEAD_SLACK:
        return None
    if missing:
        before = stream[max(0, start - missing - 2) : start].tolist()
        if head_ok is None or not head_ok(before, missing, own.tolist()):
            return None
    return Placed(tuple(own.tolist()), start, end, missing)


def _keep(chosen: list[Placed], spot: Placed, taken: Sequence[Placed]) -> None:
    """Add ``spot`` unless it overlaps ``taken`` or a longer chosen run (which it replaces
    where it is the longer)."""
    if any(spot.start < p.end and p.start < spot.end for p in taken):
        return
    clashing = [p for p in chosen if spot.start < p.end and p.start < spot.end]
    if any(_rank(p) >= _rank(spot) for p in clashing):
        return
    for p in clashing:
        chosen.remove(p)
    chosen.append(spot)


def _rank(spot: Placed) -> tuple[int, bool]:
    return spot.end - spot.start, spot.whole
