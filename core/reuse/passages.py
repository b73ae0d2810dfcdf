"""Passage cache: each passage's KV computed once after a prefix and reused at any position.

A passage is encoded with a *prefix* as its past: the prompt's own text before its first
passage (chat head, system prompt, user header), or a short anchor (BOS) where there is
none. The prefix conditions the passage's KV, so the key folds it in: one variant of a
passage per prefix. Its canonical position is ``len(prefix)``.

A prompt whose prefix holds no variant of a passage may use the variant of another known
prefix (the one sharing the most leading tokens): close, not equal, and reported as
foreign. Known prefixes are those this cache warmed, encoded under or served, newest first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.reuse.index import PassageIndex
from kvboost_rag.core.reuse.passage_encoder import PassageEncoder
from kvboost_rag.core.reuse.prefix import common_prefix
from kvboost_rag.core.store.keys import digest, token_bytes
from kvboost_rag.core.store.tiers import TieredStore

# Prefixes remembered for the fallback; an app has a few layouts, a question-first
# template one prefix per request, so old ones age out.
KNOWN_PREFIXES = 64


class Prefix(NamedTuple):
    """What passages are encoded after."""

    tokens: tuple[int, ...]
    key: bytes  # folds in the model fingerprint and the tokens


class PassageLookup(NamedTuple):
    kv: list[LayerKV]  # per passage, from its stored position len(source.tokens)
    sources: list[Prefix]  # per passage, the prefix its KV was encoded after
    hits: int
    misses: int
    encoded: int  # distinct passages encoded (a passage given twice is encoded once)
    encode_ms: float  # time spent encoding the misses


Run = Callable[[Callable[[], list[LayerKV]]], list[LayerKV]]


def _here(encode: Callable[[], list[LayerKV]]) -> list[LayerKV]:
    return encode()


class PassageCache:
    def __init__(
        self,
        store: TieredStore,
        encoder: PassageEncoder,
        fingerprint: bytes,
        anchor: list[int],
        nearest: bool,
        index: PassageIndex | None = None,
    ) -> None:
        self.store = store
        self.encoder = encoder
        self.anchor = tuple(anchor)  # the prefix of passages that have none in their prompt
        self.nearest = nearest  # whether a foreign prefix's variant may serve a passage
        # Every passage stored or found, so that prompts that do not mark it find it too.
        self.index = PassageIndex() if index is None else index
        self._root = digest(b"passage-root", fingerprint)
        self._known: OrderedDict[bytes, Prefix] = OrderedDict()
        self._served: dict[bytes, int] = {}  # prompts located per known prefix
        # Guards the two above: lookups run on callers' threads, encodes on the executor's.
        self._lock = threading.Lock()

    def prefix(self, tokens: Sequence[int]) -> Prefix:
        """The prefix passages following ``tokens`` are encoded after (the anchor when empty)."""
        tokens = tuple(tokens) or self.anchor
        return Prefix(tokens, digest(b"passage-prefix", self._root, token_bytes(tokens)))

    def key(self, prefix: Prefix, tokens: Sequence[int]) -> bytes:
        return digest(b"passage", prefix.key, token_bytes(tokens))

    def __contains__(self, item: tuple[Prefix, Sequence[int]]) -> bool:
        """Whether a (prefix, passage) variant is stored (reads no KV; it may still be
        evicted before use)."""
        return self.key(*item) in self.store

    def find(
        self, prefix: Prefix, passages: Sequence[Sequence[int]]
    ) -> list[tuple[Prefix | None, LayerKV | None]]:
        """For a prompt with ``prefix``: per passage, the prefix whose stored variant
        serves it and that variant's KV (``prefix`` itself first; with ``nearest``, else
        the known prefix sharing the most leading tokens); ``(None, None)`` when none is
        stored. Reads the tiers (every passage's own variant in one batch, the fallback's
        in another); call it before taking the model."""
        with self._lock:
            self._remember(prefix)
            self._served[prefix.key] = self._served.get(prefix.key, 0) + 1
        own = self._get_many([(prefix, tokens) for tokens in passages])
        for tokens, kv in zip(passages, own):
            if kv is not None and tokens not in self.index:  # stored by an earlier process
                self.index.add(tokens)
        out: list[tuple[Prefix | None, LayerKV | None]] = [
            (prefix, kv) if kv is not None else (None, None) for kv in own
        ]
        missing = [i for i, kv in enumerate(own) if kv is None]
        if self.nearest and missing:  # ranked on a miss only: a warmed layout never is
            self._borrow(prefix, passages, missing, out)
        return out

    def _borrow(
        self,
        prefix: Prefix,
        passages: Sequence[Sequence[int]],
        missing: list[int],
        out: list[tuple[Prefix | None, LayerKV | None]],
    ) -> None:
        """Fill ``out[i]`` for each of ``missing`` with the closest known prefix's stored
        variant. Which candidates hold one is asked in one batch (no KV read: reading every
        candidate's would move one passage's KV many times), the chosen ones' KV read in
        another; a variant gone in between is replaced by the next candidate's."""
        others = self._by_closeness(prefix)
        pairs = [(i, other) for i in missing for other in others]
        held = self.store.contains_many([self.key(p, passages[i]) for i, p in pairs])
        ranked: dict[int, list[Prefix]] = {i: [] for i in missing}
        for (i, other), there in zip(pairs, held):
            if there:
                ranked[i].append(other)
        while picks := {i: queue.pop(0) for i, queue in ranked.items() if queue}:
            kvs = self._get_many([(picks[i], passages[i]) for i in picks])
            for (i, source), kv in zip(picks.items(), kvs):
                if kv is not None:
                    with self._lock:
                        self._remember(source)
                    out[i] = (source, kv)
                    ranked[i] = []

    def recurring(self, prefix: Prefix) -> bool:
        """Whether more than one prompt with ``prefix`` was located: a layout that comes
        back, worth encoding its own variants for (a per-request prefix is not)."""
        with self._lock:
            return self._served.get(prefix.key, 0) > 1

    def cached(
        self, sources: Sequence[Prefix | None], passages: Sequence[Sequence[int]]
    ) -> list[LayerKV | None]:
        """Stored KV of each passage under its source prefix, None where there is none
        (read in one batch)."""
        asked = [(i, source) for i, source in enumerate(sources) if source is not None]
        kvs: list[LayerKV | None] = [None] * len(passages)
        found = self._get_many([(source, passages[i]) for i, source in asked])
        for (i, _), kv in zip(asked, found):
            kvs[i] = kv
        return kvs

    def fetch(
        self,
        prefix: Prefix,
        passages: Sequence[Sequence[int]],
        sources: Sequence[Prefix | None] | None = None,
        known: Sequence[LayerKV | None] | None = None,
        batch_size: int | None = None,
        progress: Callable[[int], None] | None = None,
        run: Run = _here,
    ) -> PassageLookup:
        """KV of every passage: from its source variant when stored (``sources`` default to
        ``prefix``; ``known`` is a prior ``cached()`` answer), the rest encoded after
        ``prefix`` in batches and stored. Duplicates are encoded once. Each batch's encode
        goes through ``run`` (the executor's ``call`` from another thread; by default it
        runs here, on the executor's thread)."""
        with self._lock:
            self._remember(prefix)
        sources = [prefix] * len(passages) if sources is None else sources
        known = self.cached(sources, passages) if known is None else known
        missing: dict[tuple[int, ...], list[int]] = {}
        for i, (tokens, kv) in enumerate(zip(passages, known)):
            self.index.add(tokens)
            if kv is None:
                missing.setdefault(tuple(tokens), []).append(i)
        kvs = list(known)
        used = [prefix if kv is None else source for kv, source in zip(known, sources)]
        start = time.perf_counter()
        unique = list(missing)
        # Store each batch as it is encoded: its disk writes overlap the next batch.
        for batch in self.encoder.batches(unique, batch_size):
            encoded = run(
                partial(self.encoder.encode_batch, prefix.tokens, [unique[i] for i in batch])
            )
            for i, kv in zip(batch, encoded):
                key, tokens = self.key(prefix, unique[i]), prefix.tokens + unique[i]
                self.store.put(key, tokens, kv, persist=True, approximate=True)
                for j in missing[unique[i]]:
                    kvs[j] = kv
                if progress is not None:
                    progress(1)
        encode_ms = (time.perf_counter() - start) * 1e3 if missing else 0.0
        hits = sum(kv is not None for kv in known)
        return PassageLookup(kvs, used, hits, len(passages) - hits, len(unique), encode_ms)  # type: ignore[arg-type]

    def _get_many(self, variants: Sequence[tuple[Prefix, Sequence[int]]]) -> list[LayerKV | None]:
        """The stored KV of each (prefix, passage) variant, None where there is none."""
        items = [(self.key(p, tokens), p.tokens + tuple(tokens)) for p, tokens in variants]
        return [None if entry is None else entry.kv for entry in self.store.get_many(items)]

    def _remember(self, prefix: Prefix) -> None:
        """Under ``_lock``."""
        self._known[prefix.key] = prefix
        self._known.move_to_end(prefix.key)
        while len(self._known) > KNOWN_PREFIXES:
            old, _ = self._known.popitem(last=False)
            self._served.pop(old, None)

    def _by_closeness(self, prefix: Prefix) -> list[Prefix]:
        """Known prefixes other than ``prefix``: most shared leading tokens first, then
        the most recently used."""
        with self._lock:
            newest_first = [p for p in reversed(self._known.values()) if p.key != prefix.key]
        # The anchor is always a candidate: what warming without a prefix (the CLI's warm
        # included) encodes after, in this process or an earlier one.
        anchor = self.prefix([])
        if anchor.key != prefix.key and anchor.key not in {p.key for p in newest_first}:
            newest_first.append(anchor)
        return sorted(newest_first, key=lambda p: -common_prefix(p.tokens, prefix.tokens))
