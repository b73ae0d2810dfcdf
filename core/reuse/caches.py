"""Everything one engine caches, and the three things a request asks of it: what is stored
for its prompt (``look_up``, on the caller's thread), its context built from that
(``build``, on the executor's) and what to keep after its answer (``remember``).

Nothing here waits on storage while the model waits: lookups read the tiers before the
request reaches the executor, and what an answer leaves behind is copied out of its row
and stored by the ``indexer`` thread (the index update) and the tiers' own background
writers (disk and shared-tier files). Passages a cold prompt deferred are encoded by
executor jobs that give way to requests, and pause while a lookup runs. A later lookup
waits for the index updates already queued that could change what it finds, and for a
deferred encode of a passage it needs (encoded before the others), so a request sees what
every request that ended before it stored, as in a serial run.
"""

from __future__ import annotations

import atexit
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple, Protocol

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.yielding import Preempted
from kvboost_rag.core.prompt.chunker import TokenizedPrompt
from kvboost_rag.core.prompt.placing import Placed
from kvboost_rag.core.prompt.prompts import anchor_tokens
from kvboost_rag.core.results import Timings
from kvboost_rag.core.reuse.assemble import PassageReuse, RowKV
from kvboost_rag.core.reuse.context import Context, build_context
from kvboost_rag.core.reuse.index import PassageIndex
from kvboost_rag.core.reuse.lookup import Lookup, look_up
from kvboost_rag.core.reuse.paragraphs import Breaks, paragraphs
from kvboost_rag.core.reuse.passage_encoder import PassageEncoder
from kvboost_rag.core.reuse.passages import PassageCache, Prefix
from kvboost_rag.core.reuse.plan import Plan
from kvboost_rag.core.reuse.policy import ReusePolicy, prefix_cost
from kvboost_rag.core.reuse.prefix import PrefixCache, common_prefix
from kvboost_rag.core.reuse.session import SessionCache
from kvboost_rag.core.reuse.shared import SentenceEnds
from kvboost_rag.core.store.catalogue import Catalogues
from kvboost_rag.core.store.tiers import TieredStore
from kvboost_rag.core.store.writer import Writer


class _Indexing(NamedTuple):
    """An index update queued after an answer."""

    stream: list[int]  # the tokens it indexes (prompt, and answer with cache_generated)
    start: int  # the first position it stores: what comes before is cached already
    done: threading.Event


class Pending(Protocol):
    """A queued background job (the executor's ``Job``)."""

    def hurry(self) -> None: ...


Post = Callable[[Callable[[], object]], Pending]  # queues a job on the model's executor


class Caches:
    def __init__(
        self,
        model: Any,
        support: ModelSupport,
        config: KVBoostConfig,
        store: TieredStore,
        fingerprint: bytes,
        special_prefix: list[int],
        tokenizer: Any,
        pause: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:
        self.config = config
        self.store = store
        self._decode = partial(tokenizer.decode, clean_up_tokenization_spaces=False)
        self._breaks = Breaks(tokenizer)
        self._pause = pause  # pauses the model's deferred work while a lookup runs
        self.exact = PrefixCache(store, fingerprint, config.block_tokens)
        self.reuse = _passage_reuse(
            model, support, config, store, fingerprint, special_prefix, tokenizer
        )
        self.policy = (
            self.reuse.policy
            if self.reuse is not None
            else ReusePolicy(None, nearest=False, prefix_cost=prefix_cost(model))
        )
        # An agent's or a conversation's next request extends this one: the KV it used
        # after its first reused passage (approximate, so never in the exact prefix cache)
        # is kept under a key space of its own, per repair setting, and continued from.
        self.session = (
            SessionCache(store, fingerprint, config.block_tokens, repr(config.repair_settings()))
            if self.reuse is not None
            else None
        )
        self.indexer: Writer[Callable[[], None]] = Writer("kvboost-indexer", lambda job: job())
        # An index update still running when the interpreter finalizes aborts the process.
        atexit.register(_close_at_exit, weakref.ref(self))
        # Deferred passage encodes, by passage: a lookup waits for those of its passages
        # (under any prefix: the nearest-prefix fallback may read another layout's variant),
        # and has their jobs run before the other deferred ones.
        self._encoding: dict[tuple[int, ...], threading.Event] = {}
        self._jobs: dict[tuple[int, ...], list[Pending]] = {}
        self._encoding_lock = threading.Lock()
        # Index updates queued, for the lookups they concern (``_await_index``).
        self._indexing: list[_Indexing] = []
        self._indexing_lock = threading.Lock()

    @property
    def passages(self) -> PassageCache | None:
        return None if self.reuse is None else self.reuse.cache

    # -- before the model --------------------------------------------------------------

    def look_up(self, prompt: TokenizedPrompt) -> Lookup:
        placed, new = self.place(prompt)
        self._await_encodes(placed)  # before pausing the deferred work it waits for
        with self._pause():
            self._await_index(prompt.tokens)
            return look_up(
                prompt.tokens,
                placed,
                new,
                self.exact,
                self.session,
                self.passages,
                own_prefix=self._own(),
            )

    def _await_index(self, tokens: list[int]) -> None:
        """Wait for the index updates of requests that already ended which could change
        what ``tokens`` finds: those storing past what ``tokens`` shares with their stream
        (an exact block or a continuation matches only a prompt holding all before it).
        The others go on meanwhile; they may still evict what this lookup reads."""
        with self._indexing_lock:
            due = [p for p in self._indexing if common_prefix(tokens, p.stream) > p.start]
        for pending in due:
            pending.done.wait()

    def place(self, prompt: TokenizedPrompt) -> tuple[list[Placed], list[Placed]]:
        """The prompt's passages: the marked ones and the known ones its tokens hold
        elsewhere (found by the passage index, no marker needed); and, in a prompt that
        marks none, its other long paragraphs: new passages, computed in place now and
        encoded after the answer for the next prompt that holds them."""
        cache = self.passages
        if cache is None:
            return prompt.passages, []
        found = cache.index.find(prompt.tokens, prompt.passages, self._head_ok)
        placed = sorted([*prompt.passages, *found], key=lambda p: p.start)
        if prompt.passages:
            return placed, []
        new = [
            Placed(tuple(prompt.tokens[a:b]), a, b, 0)
            for a, b in paragraphs(prompt.tokens, self._breaks)
            if not any(a < p.end and p.start < b for p in found)
        ]
        if found and new and new[-1].end == len(prompt.tokens):
            new.pop()  # after known passages, the paragraph the prompt ends in asks of them
        # Retrieval puts several documents in a prompt; one long paragraph alone is more
        # often a chat turn, which the exact prefix cache serves from then on.
        return placed, new if len(new) + len(found) > 1 else []

    def _head_ok(self, before: Sequence[int], missing: int, own: Sequence[int]) -> bool:
        """Whether ``before`` (prompt tokens) ends with the text of ``own``'s first
        ``missing`` tokens, spelled otherwise (merged with the text before them)."""
        head = self._decode(own[:missing]).lstrip()
        return self._decode(before).endswith(head)

    def _await_encodes(self, placed: list[Placed]) -> None:
        pending = []
        for tokens in [p.tokens for p in placed] if self._encoding else ():
            with self._encoding_lock:
                event, jobs = self._encoding.get(tokens), self._jobs.get(tokens, [])
            for job in jobs:
                job.hurry()
            if event is not None:
                pending.append(event)
        for event in pending:
            event.wait()

    def _own(self) -> bool:
        return self.config.passage_prefix == "prompt"

    def plan(self, tokens: list[int], lookup: Lookup) -> Plan:
        """What the request reuses, as the policy decides from what the lookup found."""
        plan = self.policy.plan(
            tokens, lookup.placed, lookup.matched, lookup.prefix, lookup.sources, lookup.approx_from
        )
        # New paragraphs the exact prefix cache holds need no passage of their own.
        new = tuple(p.tokens for p in lookup.new if p.start >= lookup.matched)
        return replace(plan, new=new) if new else plan

    # -- on the executor ---------------------------------------------------------------

    def build(self, plan: Plan, lookup: Lookup, row: RowKV, timings: Timings) -> Context:
        return build_context(plan, lookup, self.reuse, row, timings)

    def remember(self, plan: Plan, generated: list[int], row: RowKV, post: Post) -> None:
        """Queue the stores of an answered request: its new exact prefix blocks (the
        answer's too, with ``cache_generated``), its session KV, and the passages a cold
        prompt deferred. KV after the first reused passage is approximate and never
        enters the exact prefix cache."""
        stream = plan.tokens + generated[:-1] if self.config.cache_generated else plan.tokens
        exact = len(stream) if plan.exact_upto is None else plan.exact_upto
        known = min(len(stream), row.length)
        upto = min(known, exact)
        session = self.session is not None and exact < known
        start = self.exact.cached_blocks(stream[:upto]) * self.config.block_tokens
        if session:
            start = min(start, exact // self.config.block_tokens * self.config.block_tokens)
        if start < known:
            kv = row.copy(start, known)  # the row is reused once this returns
            pending = _Indexing(stream, start, threading.Event())
            with self._indexing_lock:
                self._indexing.append(pending)
            insert = partial(self._insert, stream, kv, start, upto, known, exact, plan, pending)
            if not self.indexer.submit(insert):  # closed: the interpreter is exiting
                insert()
        self._defer(plan, post)

    def _insert(
        self,
        stream: list[int],
        kv: Any,
        start: int,
        upto: int,
        known: int,
        exact: int,
        plan: Plan,
        pending: _Indexing,
    ) -> None:
        block = self.config.block_tokens
        try:
            self.exact.insert(stream, kv, upto, start // block, kv_start=start)
            if self.session is not None and exact < known:
                self.session.insert(stream, len(plan.tokens), kv, known, exact, kv_start=start)
        finally:
            with self._indexing_lock:
                self._indexing.remove(pending)
            pending.done.set()

    def _defer(self, plan: Plan, post: Post) -> None:
        """Encode, after the answer, the passages a prefilled prompt had no variant of and,
        for a layout that recurs, its own variants of the ones it borrowed."""
        cache = self.passages
        if cache is None or plan.prefix is None:
            return
        encode = self.policy.deferred(plan, cache.recurring(plan.prefix))
        if not encode:
            return
        prefix = plan.prefix
        events = {}
        with self._encoding_lock:
            for tokens in encode:
                events[tokens] = self._encoding.setdefault(tokens, threading.Event())
        for tokens in encode:  # known now: a prompt arriving before its encode waits for it
            cache.index.add(tokens)
        for tokens in encode:  # one job per passage: a request waits for one at most
            job = post(partial(self._encode, prefix, tokens, events[tokens]))
            with self._encoding_lock:
                if self._encoding.get(tokens) is events[tokens]:  # not done already
                    self._jobs.setdefault(tokens, []).append(job)

    def _encode(self, prefix: Prefix, tokens: tuple[int, ...], event: threading.Event) -> None:
        """Encode and store a deferred passage; a request arriving meanwhile drops the
        encode (``Preempted``: nothing was stored) and it runs again later."""
        assert self.passages is not None
        try:
            self.passages.fetch(prefix, [tokens], [None])
        except Preempted:
            raise  # still to come: whoever waits for it goes on waiting
        except BaseException:
            self._encoded(tokens, event)
            raise
        self._encoded(tokens, event)

    def _encoded(self, tokens: tuple[int, ...], event: threading.Event) -> None:
        with self._encoding_lock:
            if self._encoding.get(tokens) is event:
                del self._encoding[tokens]
                self._jobs.pop(tokens, None)
        event.set()


def _close_at_exit(ref: weakref.ref[Caches]) -> None:
    caches = ref()
    if caches is not None:
        caches.indexer.close()


def _catalogues(store: TieredStore) -> Catalogues | None:
    found = store.catalogues()
    return Catalogues(found) if found else None


def _passage_reuse(
    model: Any,
    support: ModelSupport,
    config: KVBoostConfig,
    store: TieredStore,
    fingerprint: bytes,
    special_prefix: list[int],
    tokenizer: Any,
) -> PassageReuse | None:
    nearest = config.prefix_fallback == "nearest"
    policy = ReusePolicy(config.repair_settings(), nearest, prefix_cost(model))
    if policy.repair is None:  # fidelity "exact"
        return None
    if not support.passage_reuse:
        warnings.warn(f"{support.reason}; using exact prefix reuse only", stacklevel=4)
        return None
    anchor = anchor_tokens(tokenizer, special_prefix) if config.passage_anchor else []
    # What the disk and shared tiers hold is found unmarked by other processes too.
    catalogue = _catalogues(store)
    index = PassageIndex(
        known=None if catalogue is None else catalogue.read_new,
        record=None if catalogue is None else catalogue.add,
    )
    cache = PassageCache(
        store,
        PassageEncoder(model, config.encode_batch_tokens),
        fingerprint,
        anchor,
        nearest=policy.nearest,
        index=index,
    )
    return PassageReuse(model, cache, support, policy, SentenceEnds(tokenizer))
