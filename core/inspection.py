"""``KVBoost.inspect``: a view of what an engine made of a prompt and what its caches hold,
for measuring and debugging. Serving requests never needs it.

The studies in the repository's ``benchmarks/`` folder, ``kvboost-rag bench`` and the tests
read the engine through it instead of its private attributes, so the engine can change
inside without them reaching past this one door.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvboost_rag.core.prompt.chunker import TokenizedPrompt
from kvboost_rag.core.prompt.prompts import Message, PromptEncoder
from kvboost_rag.core.reuse.caches import Caches
from kvboost_rag.core.reuse.lookup import Lookup
from kvboost_rag.core.reuse.passages import PassageCache
from kvboost_rag.core.store.tiers import TieredStore

if TYPE_CHECKING:
    from kvboost_rag.core.generation.handle import ModelHandle
    from kvboost_rag.core.generation.profile import SpeedProfile

__all__ = ["Inspection"]


class Inspection:
    """An engine's insides, for measuring and debugging (``engine.inspect``).

    Members return the engine's own objects, not copies: read them. A measurement may wrap
    one of their methods to count or time the calls (the shared tier's reads, the passage
    encoder's batches); nothing here is meant to change an answer. Thread-safe where the
    object returned is (the tiers and caches lock their own). Unlike ``generate`` / ``chat``
    and the results they return, these members follow the engine's insides and may change
    with them between releases.
    """

    def __init__(
        self, prompts: PromptEncoder, caches: Caches, tiers: TieredStore, handle: ModelHandle
    ) -> None:
        self._prompts = prompts
        self._caches = caches
        self._tiers = tiers
        self._handle = handle

    def prompt(
        self, prompt: str | Sequence[Message], passages: Sequence[str] | None = None
    ) -> TokenizedPrompt:
        """What the model sees for ``prompt``, a text (with ``passages`` before it, as
        ``generate`` takes them) or chat messages (through the chat template, as ``chat``
        without tools): ``.tokens``, the token ids, and ``.passages``, where each passage
        lies in them (``.start`` / ``.end``, prompt positions; ``.tokens``, its own)."""
        if isinstance(prompt, str):
            return self._prompts.text(prompt, passages)
        if passages is not None:
            raise TypeError("passages= goes with a text prompt; put them in the messages")
        return self._prompts.chat(prompt)

    def passages(self, texts: Sequence[str] | str) -> list[list[int]]:
        """Each passage's own token ids as the passage cache keys and encodes them (what
        ``warm_passages`` would encode for ``texts``; a long text splits into pieces)."""
        return self._prompts.passages(texts)

    @property
    def passage_cache(self) -> PassageCache | None:
        """The passage cache: its ``key`` and ``prefix`` (how a passage's KV is named in
        every tier) and its ``encoder`` (the batched passage prefill). None at fidelity
        "exact" or for a model whose KV cannot move (``engine.support.reason``)."""
        reuse = self._caches.reuse
        return None if reuse is None else reuse.cache

    @property
    def tiers(self) -> TieredStore:
        """The KV store: ``.tiers``, in the order they are asked (``.memory`` first; the
        disk and the shared tier after it when configured), ``.tier(name)`` for one by
        name (``"disk"``, ``"remote"``; None when not open), each with its ``stats()``."""
        return self._tiers

    def look_up(self, prompt: TokenizedPrompt) -> Lookup:
        """What the caches hold for ``prompt`` now, read from every tier (the step a
        request takes on the caller's thread before its model is taken): the exact prefix
        ``matched`` and each passage's KV (``passage_kv``, None where not found). Nothing
        is computed or stored."""
        return self._caches.look_up(prompt)

    def profile(self) -> SpeedProfile:
        """What makes this model's forwards fast, as the engine chose it on this machine
        (packed linear layers, compiled step, threads, ...)."""
        return self._handle.profile()
