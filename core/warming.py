"""Warming: computing KV before the requests that reuse it (a prefix, or passages for the
prompt layout they will be used in). ``KVBoost``'s warm methods hand over to a ``Warmer``.

Tier reads happen on the caller's thread; each forward runs on the model's executor as a
job between its turns (one encoding batch per job), so warming a corpus never stops the
answers streaming meanwhile for longer than one batch."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvboost_rag.core.caller_warnings import warn
from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.errors import ContextWindowError
from kvboost_rag.core.generation.executor import Executor
from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.kv import LayerKV, blocks_cache, kv_nbytes, layer_kv
from kvboost_rag.core.prompt.prompts import Message, PromptEncoder
from kvboost_rag.core.results import WarmResult
from kvboost_rag.core.reuse.assemble import PassageReuse
from kvboost_rag.core.reuse.caches import Caches
from kvboost_rag.core.store.tiers import CacheStats


class Warmer:
    def __init__(
        self,
        model: Any,
        config: KVBoostConfig,
        support: ModelSupport,
        prompts: PromptEncoder,
        caches: Caches,
        executor: Executor,
    ) -> None:
        self.model = model
        self.config = config
        self.support = support
        self._prompts = prompts
        self._caches = caches
        self._executor = executor

    def warm(self, text: str) -> WarmResult:
        """Prefill ``text`` and cache it as an exact prefix of later prompts (written
        through to ``cache_dir`` when set; on disk when it returns)."""
        start = time.perf_counter()
        before = self._caches.store.stats()
        tokens = self._prompts.text(text).tokens
        units, count, cached, new, nbytes = self._warm_exact(tokens)
        self._caches.store.flush()
        keys = self._caches.exact.keys(tokens)  # the full blocks; the partial last is newest
        dropped = len(keys) - sum(self._caches.store.contains_many(keys))
        self._warn_dropped(dropped, units, "prefix blocks", nbytes)
        held = nbytes - dropped * self.config.block_tokens * (nbytes // max(count, 1))
        seconds = time.perf_counter() - start
        failed = self._failed_tiers(before)
        return WarmResult(1, units, count, cached, new, held, seconds, 0, dropped, failed)

    def _warm_exact(self, tokens: list[int]) -> tuple[int, int, int, int, int]:
        """Cache ``tokens`` as an exact prefix: its units (blocks, the partial last one
        included), tokens, units cached before, units stored now, and their KV bytes."""
        self._caches.indexer.join()
        match = self._caches.exact.match(tokens)
        kv = self._executor.call(lambda: self._prefill(tokens, match.blocks, match.length))
        new = 0
        if match.length < len(tokens):
            new = self._caches.exact.insert(tokens, kv, len(tokens), persist=True)
        blocks = -(-len(tokens) // self.config.block_tokens)
        cached = -(-match.length // self.config.block_tokens)
        return blocks, len(tokens), cached, new, kv_nbytes(kv)

    def _prefill(self, tokens: list[int], blocks: list[LayerKV], matched: int) -> LayerKV:
        with torch.inference_mode():
            cache = blocks_cache(blocks, self.model.config, matched)
            if matched < len(tokens):
                tail = torch.tensor([tokens[matched:]], device=self.model.device)
                self.model(input_ids=tail, cache=cache, use_cache=True, logits_to_keep=1)
            return layer_kv(cache)

    def warm_passages(
        self,
        texts: Sequence[str] | str,
        *,
        prefix: str | Sequence[Message] | None = None,
        batch_size: int | None = None,
        progress: Callable[[int], None] | None = None,
        names: Sequence[str] | None = None,
    ) -> WarmResult:
        """Encode and cache passages so later prompts that contain them reuse their KV
        (written through to ``cache_dir`` when set).

        Each text of a list is one passage (long ones split at sentences, as in prompts);
        a single string is a prompt whose ``passage()``-marked passages are warmed.
        ``prefix`` is the prompt layout they will be used in (see ``passage_prefix``):
        passages are encoded after it, as in that prompt. Without it they are encoded after
        BOS only, which any prompt can use through ``prefix_fallback="nearest"`` at lower
        accuracy (``GenerationResult.passages_foreign`` counts such uses).
        With ``prefix``, the prompts' head (their tokens before the first passage) is also
        cached as an exact prefix, so the first request reuses it as later ones do.
        ``batch_size`` caps the passages per forward pass (default: by padded tokens).
        ``progress`` is called with the number of pieces done as batches finish. ``names``:
        what errors call each text (default ``texts[i]``). Returns once the KV is on disk
        too, with the passages' counts: a piece given twice is one unit, counted once (the
        head's blocks are not counted), checked against the tiers' own stats: ``bytes`` of
        what they hold then, ``dropped`` units they do not (warned), ``failed`` tiers. A
        text that is empty or only whitespace is skipped with a warning naming it
        (``skipped``). An engine that reuses no passages (``fidelity="exact"``, or a model
        whose positions cannot be moved) warns and returns an empty result. Raises
        ``ValueError`` for a ``batch_size`` that is not a positive int,
        ``ContextWindowError`` naming the first text with a piece that does not fit the
        context window after the prefix.
        """
        _check_batch_size(batch_size)
        start = time.perf_counter()
        documents = 1 if isinstance(texts, str) else len(texts)
        reuse = self._caches.reuse
        if reuse is None:  # nothing a request would read: checked, then an empty warm
            _, counts = self._fitting_pieces(texts, names, len(self._head(prefix)))
            warn(f"kvboost-rag: nothing warmed: {self._no_reuse()}")
            seconds = time.perf_counter() - start
            skipped = counts.count(0) if not isinstance(texts, str) else 0
            return WarmResult(documents, 0, 0, 0, 0, 0, seconds, skipped, pieces=tuple(counts))
        before = self._caches.store.stats()
        head = self._head(prefix)
        conditioning = reuse.cache.prefix(head)
        found, counts = self._fitting_pieces(texts, names, len(conditioning.tokens))
        pieces = list(dict.fromkeys(map(tuple, found)))  # a passage given twice is one entry
        if head:  # the prompts' own head, so their first request reuses it too
            self._warm_exact(head)
        fetched = reuse.cache.fetch(
            conditioning, pieces, batch_size=batch_size, progress=progress, run=self._encode
        )
        self._caches.store.flush()  # warmed means on disk, for every process
        keys = [reuse.cache.key(conditioning, piece) for piece in pieces]
        held = self._caches.store.contains_many(keys)
        sizes = [kv_nbytes(kv) for kv in fetched.kv]
        self._warn_dropped(held.count(False), len(pieces), "passages", sum(sizes))
        return WarmResult(
            documents=documents,
            units=len(pieces),
            tokens=sum(map(len, pieces)),
            cached=fetched.hits,
            new=fetched.encoded,
            bytes=sum(size for size, there in zip(sizes, held) if there),
            seconds=time.perf_counter() - start,
            skipped=counts.count(0) if not isinstance(texts, str) else 0,
            dropped=held.count(False),
            failed=self._failed_tiers(before),
            pieces=tuple(counts),
        )

    def _warn_dropped(self, dropped: int, units: int, what: str, nbytes: int) -> None:
        """A warning when the tiers hold fewer than all ``units`` a warm made: its KV did
        not fit their budgets, so LRU evicted the oldest again (issue 48: a 3.5 GB warm
        into the 2 GiB memory tier reported success)."""
        if not dropped:
            return
        budgets = f"max_cache_bytes={self.config.max_cache_bytes}"
        disk = self._caches.store.tier("disk") is not None
        if disk:
            budgets += f", max_disk_bytes={self.config.max_disk_bytes}"
        more = "raise them" if disk else "raise it or set cache_dir"
        warn(
            f"kvboost-rag: {dropped} of the {units} {what} this warm made are not cached when "
            f"it returns: their {nbytes} bytes of KV are more than the tiers hold ({budgets}), "
            f"so the oldest were evicted again; {more}, or warm less"
        )

    def _failed_tiers(self, before: CacheStats) -> tuple[str, ...]:
        """The tiers that did not store this warm, by their own stats since ``before``."""
        after = self._caches.store.stats()
        failed = []
        if self.config.cache_dir is not None and after.disk is None:
            failed.append("disk")  # cache_dir could not hold a cache: warned when opened
        if after.remote is not None and before.remote is not None:
            if after.remote.errors > before.remote.errors or not after.remote.available:
                failed.append("remote")
        return tuple(failed)

    def _encode(self, encode: Callable[[], list[LayerKV]]) -> list[LayerKV]:
        def job() -> list[LayerKV]:
            with torch.inference_mode():
                return encode()

        return self._executor.call(job)

    def _fitting_pieces(
        self, texts: Sequence[str] | str, names: Sequence[str] | None, prefix_tokens: int
    ) -> tuple[list[list[int]], list[int]]:
        """Every text's pieces, each text tokenized alone so that one that cannot be
        encoded after ``prefix_tokens`` tokens is named; and how many each text became (0:
        skipped with a warning for holding no passage, empty or only whitespace, as the
        CLI skips such a file rather than failing the whole warm)."""
        if isinstance(texts, str):  # a prompt: its marked passages
            groups: list[Sequence[str] | str] = [texts]
            names = names or ["a passage of the prompt"]
        else:
            groups = [[text] for text in texts]
            names = names or [f"texts[{i}]" for i in range(len(texts))]
        assert len(names) == len(groups), "one name per text"
        pieces: list[list[int]] = []
        counts: list[int] = []
        for group, name in zip(groups, names):
            own = self._text_pieces(group, name, prefix_tokens)
            if not own and not isinstance(group, str):  # a prompt may mark no passage
                what = "empty" if not group[0] else "only whitespace"
                warn(f"kvboost-rag: skipping {name}: it is {what} (no passage to warm)")
            pieces += own
            counts.append(len(own))
        return pieces, counts

    def _text_pieces(
        self, group: Sequence[str] | str, name: str, prefix_tokens: int
    ) -> list[list[int]]:
        try:
            own = self._prompts.passages(group)
            longest = max(map(len, own), default=0)
        except ContextWindowError as error:  # a piece too long even without the prefix
            own, longest = [], error.prompt_tokens
        if prefix_tokens + longest >= self._prompts.context_window:
            raise ContextWindowError(
                prefix_tokens + longest,
                self._prompts.context_window,
                f"{name}: its longest piece ({longest} tokens) after the "
                f"{prefix_tokens}-token prefix",
                "set KVBoostConfig(max_passage_tokens=) below "
                f"{self._prompts.context_window - prefix_tokens} (long documents are split "
                "into pieces of at most that many tokens), or warm it after a shorter prefix",
            )
        return own

    def passage_prefix(self, prefix: str | Sequence[Message] | None) -> list[int]:
        """The tokens passages are encoded after for prompts laid out like ``prefix``.

        ``prefix``: a completion prompt as ``generate`` takes it (the text before its first
        ``passage()`` marker; all of it when it has none), chat messages as ``chat`` takes
        them with a ``passage()`` marker where the passages go (the rendered chat template
        before it), or None (BOS only). Raises ``ValueError`` for messages that mark no
        passage, or a prefix given with ``passage_prefix="anchor"``.
        """
        reuse = self._passage_reuse_on()
        return list(reuse.cache.prefix(self._head(prefix)).tokens)

    def _head(self, prefix: str | Sequence[Message] | None) -> list[int]:
        """The tokens prompts laid out like ``prefix`` have before their first passage;
        none for None (passages are then encoded after the anchor)."""
        if prefix is None:
            return []
        if self.config.passage_prefix == "anchor":
            raise ValueError(
                'passage_prefix="anchor" encodes every passage after BOS only: drop prefix=, '
                'or use passage_prefix="prompt" to encode passages after it'
            )
        head = self._prompts.prefix(prefix)
        if len(head) >= self._prompts.context_window:
            raise ContextWindowError(
                len(head), self._prompts.context_window, "the prefix", "shorten the prefix"
            )
        return head

    def _passage_reuse_on(self) -> PassageReuse:
        if self._caches.reuse is None:
            raise ValueError(self._no_reuse())
        return self._caches.reuse

    def _no_reuse(self) -> str:
        """Why this engine reads no passage's KV, and what would."""
        if self.config.fidelity == "exact":
            return (
                'passage reuse is off (fidelity="exact" prefills every prompt whole), so no '
                'request reads a warmed passage; fidelity="balanced" (the default) does'
            )
        return f"passage reuse is off ({self.support.reason}), so no request reads a passage"


def _check_batch_size(batch_size: object) -> None:
    if batch_size is not None and (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, numbers.Integral)
        or batch_size < 1
    ):
        raise ValueError(
            f"batch_size must be an int >= 1 (passages per forward pass) or None (batches "
            f"sized by padded tokens), got {batch_size!r}"
        )
