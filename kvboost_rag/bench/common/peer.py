"""The ``kvboost`` PyPI package (chunk-level KV reuse) as a peer in the benchmark.

It runs on the very model object the other systems use (same weights, dtype, threads)
with its default settings (128-token chunks, "selective" seam repair). Two things differ
from calling it naively, both so the comparison is like for like:

- Token ids: its ``generate`` takes a string and re-tokenizes it; here its ``_encode`` is
  pointed at the exact ids every other system gets, so fidelity compares caches, not
  tokenizations.
- TTFT: its ``GenerationResult.ttft_ms`` starts after cache assembly and seam repair. The
  benchmark times from the call to the first token (its ``on_token`` callback) and keeps
  the package's own figure beside it as ``self_reported_ttft_ms``.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvboost_rag import GenerationResult, KVBoost, Timings
from kvboost_rag.core.prompt.prompts import Message


def peer_version() -> str | None:
    """The installed ``kvboost`` version, or None when it is not installed."""
    try:
        return importlib.metadata.version("kvboost")
    except importlib.metadata.PackageNotFoundError:
        return None


class PeerEngine:
    """``kvboost.KVBoost`` behind the calls the benchmarks make on a ``KVBoost`` engine."""

    def __init__(self, base: KVBoost, max_cache_bytes: int = 2 * 1024**3) -> None:
        from kvboost import KVBoost as Peer

        self.model, self.tokenizer = base.model, base.tokenizer
        self._base = base
        self._peer = Peer(base.model, base.tokenizer, max_cache_bytes=max_cache_bytes)
        self._prompts: dict[str, list[int]] = {}
        self._peer._encode = self._encode  # type: ignore[method-assign]  # shadows the method
        self._last: tuple[list[int], torch.Tensor] | None = None
        self.self_reported_ttft_ms: list[float] = []

    def _encode(self, text: str) -> list[int]:
        if text in self._prompts:
            return self._prompts.pop(text)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def chat(self, messages: Sequence[Message], max_new_tokens: int = 16) -> GenerationResult:
        start = time.perf_counter()
        tokens = self._base.tokenize_chat(messages)
        key = f"<prompt {len(self.self_reported_ttft_ms)}>"
        self._prompts[key] = tokens
        ids: list[int] = []
        stamps: list[float] = []

        def on_token(token: int) -> None:
            stamps.append(time.perf_counter())
            ids.append(token)

        r = self._peer.generate(key, max_new_tokens=max_new_tokens, on_token=on_token)
        end = time.perf_counter()
        first = stamps[0] if stamps else end
        self.self_reported_ttft_ms.append(r.ttft_ms)
        if r.first_token_logits is not None:
            self._last = (tokens, torch.from_numpy(r.first_token_logits).float())
        return GenerationResult(
            text=r.output_text,
            token_ids=ids,
            finish_reason="length" if len(ids) >= max_new_tokens else "stop",
            prompt_tokens=len(tokens),
            reused_tokens=r.cached_tokens,
            recomputed_tokens=len(tokens) - r.cached_tokens,
            ttft_ms=(first - start) * 1e3,
            total_ms=(end - start) * 1e3,
            timings=Timings(decode_ms=(end - first) * 1e3),
        )

    def tokenize_chat(self, messages: Sequence[Message]) -> list[int]:
        return self._base.tokenize_chat(messages)

    def first_token_logits(self, messages: Sequence[Message]) -> torch.Tensor:
        """The first-token logits of the last ``chat`` on these messages (the timed call
        itself), else of a fresh one-token call."""
        tokens = self._base.tokenize_chat(messages)
        if self._last is None or self._last[0] != tokens:
            self.chat(messages, max_new_tokens=1)
        assert self._last is not None and self._last[0] == tokens
        return self._last[1]

    def warm_passages(self, texts: Sequence[str]) -> int:
        """Each passage through the package's ``warm`` (its API for documents); returns
        the chunks it stored."""
        return sum(self._peer.warm(text).chunks_stored for text in texts)

    def clear_cache(self) -> None:
        self._peer.reset_cache()

    def cache_bytes(self) -> int:
        return int(self._peer.cache_stats()["hot_memory_mb"] * 1e6)

    def settings(self) -> dict[str, Any]:
        p = self._peer
        return {
            "version": peer_version(),
            "chunk_size": p.chunk_registry.chunk_size,
            "recompute_strategy": p.recompute_strategy.value,
        }
