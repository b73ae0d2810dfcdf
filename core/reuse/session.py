"""The session cache: the KV a request used after its first reused passage, for the request
that continues it (the next agent step, the next chat turn).

That KV is approximate (reused passages, repaired), so it never enters the exact prefix
cache. A request whose prompt holds an earlier prompt *and its answer* continues the same
exchange, though: the earlier request's KV is what produced that answer, and reusing it
spares the passages' assembly and repair a second time. Only such continuations are
served; a prompt that shares passages with an earlier one but not its answer (a new
question over the same documents) takes the passage route and its own repair.

Keyed per repair setting (a "fast" engine's KV never serves a "balanced" one) on top of the
prefix cache's block chain, so a continuation reads its history block by block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.reuse.prefix import PrefixCache, PrefixMatch
from kvboost_rag.core.store.tiers import TieredStore

# Answers a later request may continue, each as (the key of the last whole block before
# it, the tokens from there to its first generated token). Old ones go first; a forgotten
# one is only a missed shortcut.
MAX_CONTINUATIONS = 4096


class SessionCache:
    """Thread-safe, as ``PrefixCache`` (its answers index has a lock of its own)."""

    def __init__(
        self, store: TieredStore, fingerprint: bytes, block_tokens: int, setting: str
    ) -> None:
        namespace = b"session:" + setting.encode()
        # Local tiers only: a request's session KV spans its whole prompt and answer, and
        # writing it through would fill the shared tier (and evict warmed passages there)
        # with KV that only a continuation of this one conversation can use.
        self._blocks = PrefixCache(
            store, fingerprint, block_tokens, namespace, approximate=True, shared=False
        )
        self._answers: OrderedDict[tuple[bytes, tuple[int, ...]], None] = OrderedDict()
        self._by_parent: dict[bytes, set[tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self.block_tokens = block_tokens

    def match(self, tokens: Sequence[int], exact: int) -> PrefixMatch | None:
        """Session KV continuing the exact prefix (``exact`` tokens long) further into
        ``tokens``, from the block holding position ``exact``; None unless the match holds
        an earlier request's prompt and the start of its answer."""
        first = exact // self.block_tokens
        more = self._blocks.match(tokens, first)
        if more.length <= exact or not self._continues(tokens[: more.length], first):
            return None
        return more

    def insert(
        self,
        stream: Sequence[int],
        prompt_tokens: int,
        kv: LayerKV,
        upto: int,
        exact: int,
        kv_start: int = 0,
    ) -> None:
        """Keep ``kv`` (positions [``kv_start``, ``upto``) of ``stream``, ``kv_start`` at
        most the start of the block holding ``exact``) for ``stream[exact:upto]``: the
        prompt, then the answer from position ``prompt_tokens``; whole blocks from the one
        holding ``exact``."""
        self._blocks.insert(stream, kv, upto, exact // self.block_tokens, kv_start)
        if upto <= prompt_tokens:
            return  # no answer token in the stream: nothing to continue
        block = prompt_tokens // self.block_tokens
        start = block * self.block_tokens
        answer = (self._blocks.parent_key(stream, block), tuple(stream[start : prompt_tokens + 1]))
        with self._lock:
            self._answers[answer] = None
            self._answers.move_to_end(answer)
            self._by_parent.setdefault(answer[0], set()).add(answer[1])
            while len(self._answers) > MAX_CONTINUATIONS:
                (parent, tokens), _ = self._answers.popitem(last=False)
                self._by_parent[parent].discard(tokens)
                if not self._by_parent[parent]:
                    del self._by_parent[parent]

    def _continues(self, matched: Sequence[int], first: int) -> bool:
        """Whether ``matched`` holds a known prompt and its answer's first token."""
        parents = [self._blocks.parent_key(matched, 0), *self._blocks.keys(matched)]
        for block in range(first, -(-len(matched) // self.block_tokens)):
            start = block * self.block_tokens
            with self._lock:
                known = list(self._by_parent.get(parents[block], ()))
            for tokens in known:
                if tuple(matched[start : start + len(tokens)]) == tokens:
                    return True
        return False
