"""The engine: tokenize, reuse cached KV, generate, store what is new."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvboost_rag.core.arch import model_support
from kvboost_rag.core.chunker import TokenizedPrompt
from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.context import Context, ContextBuilder
from kvboost_rag.core.decoding import decode, eos_ids, model_lock
from kvboost_rag.core.disk import DiskStore
from kvboost_rag.core.fingerprint import model_fingerprint
from kvboost_rag.core.kv import blocks_cache, kv_nbytes
from kvboost_rag.core.loading import default_device, default_dtype, load_model, resolve_model_path
from kvboost_rag.core.passages import PassageCache
from kvboost_rag.core.prefix import PrefixCache
from kvboost_rag.core.prompts import Message, PromptEncoder, anchor_tokens
from kvboost_rag.core.result import (
    EngineStats,
    GenerationResult,
    PassageWarmResult,
    Timings,
    WarmResult,
    elapsed_ms,
)
from kvboost_rag.core.sampling import SamplingOptions
from kvboost_rag.core.streaming import Cancelled, GenerationStream, TokenCollector, cut_at_stop
from kvboost_rag.core.tiers import TieredStore


class KVBoost:
    """A model, its tokenizer and KV caches that make repeated context cheap.

    Safe to share between threads: requests run one at a time under a lock held by the
    model (one forward pass already uses every core), so results equal serial calls, also
    across several engines wrapping the same model.
    """

    def __init__(self, model: Any, tokenizer: Any, config: KVBoostConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or KVBoostConfig()
        # What integrations report as the model's name; from_pretrained sets what was asked.
        self.name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.fingerprint = model_fingerprint(model, tokenizer)
        self.context_window = int(model.config.max_position_embeddings)
        self._prompts = PromptEncoder(
            tokenizer, self.context_window, self.config.max_passage_tokens
        )
        disk = (
            DiskStore(self.config.cache_dir, self.fingerprint, self.config.max_disk_bytes)
            if self.config.cache_dir is not None
            else None
        )
        self._store = TieredStore(self.config.max_cache_bytes, disk)
        self._prefix = PrefixCache(self._store, self.fingerprint, self.config.block_tokens)
        self.support = model_support(model)
        self._passages = self._passage_cache()
        repair = self.config.repair_settings() if self._passages is not None else None
        rotaries = self.support.rotaries
        self._context = ContextBuilder(model, self._prefix, self._passages, rotaries, repair)
        self._lock = model_lock(model)
        self._requests = self._prompt_tokens = self._reused_tokens = 0

    def _passage_cache(self) -> PassageCache | None:
        if self.config.fidelity == "exact":
            return None
        if not self.support.passage_reuse:
            warnings.warn(f"{self.support.reason}; using exact prefix reuse only", stacklevel=3)
            return None
        anchor = (
            anchor_tokens(self.tokenizer, self._prompts.special_prefix)
            if self.config.passage_anchor
            else []
        )
        return PassageCache(
            self._store, self.model, self.fingerprint, anchor, self.config.encode_batch_tokens
        )

    @classmethod
    def from_pretrained(
        cls,
        model: str = "smollm2-135m-instruct",
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        config: KVBoostConfig | None = None,
        **model_kwargs: Any,
    ) -> KVBoost:
        """Load an embedded alias (``"smollm2-135m-instruct"``), a local path or an HF id."""
        dev = torch.device(device) if device is not None else default_device()
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        path = resolve_model_path(model)
        hf_model, tokenizer = load_model(path, dtype or default_dtype(dev), dev, **model_kwargs)
        engine = cls(hf_model, tokenizer, config)
        engine.name = model
        return engine

    # -- public requests -------------------------------------------------------------

    def generate(
        self, prompt: str, *, passages: Sequence[str] | None = None, **options: Any
    ) -> GenerationResult:
        """Complete ``prompt``. Passages may be marked inside it with ``passage(text)`` or
        given as ``passages=`` (placed before it). Options: max_new_tokens, temperature,
        top_p, top_k, stop, seed."""
        start = time.perf_counter()
        sampling = SamplingOptions.build(**options)
        return self._run(self._prompts.text(prompt, passages), sampling, start, None, Cancelled())

    def chat(self, messages: Sequence[Message], **options: Any) -> GenerationResult:
        """Answer the last message of a conversation, using the tokenizer's chat template."""
        start = time.perf_counter()
        sampling = SamplingOptions.build(**options)
        return self._run(self._prompts.chat(messages), sampling, start, None, Cancelled())

    def stream(
        self, prompt: str, *, passages: Sequence[str] | None = None, **options: Any
    ) -> GenerationStream:
        """Like ``generate`` but yields text deltas; ``.result`` is set when it ends."""
        start = time.perf_counter()
        sampling = SamplingOptions.build(**options)
        return self._stream(self._prompts.text(prompt, passages), sampling, start)

    def stream_chat(self, messages: Sequence[Message], **options: Any) -> GenerationStream:
        start = time.perf_counter()
        sampling = SamplingOptions.build(**options)
        return self._stream(self._prompts.chat(messages), sampling, start)

    def warm(self, text: str) -> WarmResult:
        """Prefill ``text`` and cache it as an exact prefix of later prompts."""
        tokens = self._prompts.text(text).tokens
        with self._lock, torch.inference_mode():
            match = self._prefix.match(tokens)
            if match.length < len(tokens):
                cache = blocks_cache(match.blocks, self.model.config)
                tail = torch.tensor([tokens[match.length :]], device=self.model.device)
                self.model(input_ids=tail, cache=cache, use_cache=True, logits_to_keep=1)
                stored = self._prefix.insert(tokens, cache, len(tokens))
            else:
                stored = 0
        return WarmResult(len(tokens), match.length, stored)

    def warm_passages(
        self,
        texts: Sequence[str] | str,
        *,
        batch_size: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> PassageWarmResult:
        """Encode and cache passages so later prompts that contain them reuse their KV
        (written through to ``cache_dir`` when set).

        A list of texts is laid out as ``format_passages`` / ``passages=`` lay it out; a
        single string is a prompt whose ``passage()``-marked passages are warmed as marked.
        ``batch_size`` caps the passages per forward pass (default: by padded tokens).
        ``progress`` is called with the number of pieces done as batches finish. Returns
        once the KV is on disk too.
        """
        if self._passages is None:
            raise ValueError('passage reuse is off (fidelity="exact" or a model without RoPE)')
        pieces = self._prompts.passages(texts)
        with self._lock, torch.inference_mode():
            found = self._passages.fetch(pieces, batch_size=batch_size, progress=progress)
            self._store.flush()  # warmed means on disk, for every process
        return PassageWarmResult(
            len(pieces),
            sum(map(len, pieces)),
            found.hits,
            found.misses,
            sum(kv_nbytes(kv) for kv in found.kv),
        )

    def first_token_logits(
        self, prompt: str | Sequence[Message], *, passages: Sequence[str] | None = None
    ) -> torch.Tensor:
        """Next-token logits after ``prompt`` (text, or chat messages), computed on the same
        cached path as ``generate`` / ``chat``, for fidelity checks against a full prefill.
        Stores no prefix; passages it encodes are cached, as in ``generate``."""
        tokenized = (
            self._prompts.text(prompt, passages)
            if isinstance(prompt, str)
            else self._prompts.chat(prompt)
        )
        with self._lock, torch.inference_mode():
            context = self._context.build(tokenized, Timings())
            if context.logits is not None:
                return context.logits.float()
            done = context.cache.get_seq_length()
            rest = torch.tensor([tokenized.tokens[done:]], device=self.model.device)
            out = self.model(input_ids=rest, cache=context.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def tokenize(self, prompt: str, *, passages: Sequence[str] | None = None) -> list[int]:
        """The exact token ids the model sees for ``prompt`` (markers removed)."""
        return self._prompts.text(prompt, passages).tokens

    def tokenize_chat(self, messages: Sequence[Message]) -> list[int]:
        """The exact token ids the model sees for ``messages`` (markers removed)."""
        return self._prompts.chat(messages).tokens

    def stats(self) -> EngineStats:
        with self._lock:
            tiers = self._store.stats()
            return EngineStats(
                tiers.memory, tiers.disk, self._requests, self._prompt_tokens, self._reused_tokens
            )

    def clear_cache(self) -> None:
        self._store.clear()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the request path ------------------------------------------------------------

    def _stream(
        self, prompt: TokenizedPrompt, sampling: SamplingOptions, start: float
    ) -> GenerationStream:
        return GenerationStream(
            lambda on_token, cancel: self._run(prompt, sampling, start, on_token, cancel),
            self._decode,
            sampling.stop,
        )

    def _run(
        self,
        prompt: TokenizedPrompt,
        sampling: SamplingOptions,
        start: float,
        on_token: Callable[[int], None] | None,
        cancel: Cancelled,
    ) -> GenerationResult:
        timings = Timings(tokenize_ms=elapsed_ms(start))
        tokens = prompt.tokens
        with self._lock, torch.inference_mode():
            context = self._context.build(prompt, timings)
            collector = TokenCollector(on_token)
            gen_start = time.perf_counter()
            max_new = min(sampling.max_new_tokens, self.context_window - len(tokens))
            decode(
                self.model, self.tokenizer, tokens, context, sampling, max_new, collector, cancel
            )
            end = time.perf_counter()
            first = collector.first_token_at or end
            timings.prefill_ms = (first - gen_start) * 1e3
            timings.decode_ms = (end - first) * 1e3
            result = self._result(tokens, collector.token_ids, sampling, cancel, context)
            result.ttft_ms = (first - start) * 1e3
            result.timings = timings
            t = time.perf_counter()
            self._remember(tokens, collector.token_ids, context)
            timings.store_ms = elapsed_ms(t)
            result.total_ms = elapsed_ms(start)
            self._requests += 1
            self._prompt_tokens += len(tokens)
            self._reused_tokens += context.reused
        return result

    def _result(
        self,
        tokens: list[int],
        ids: list[int],
        sampling: SamplingOptions,
        cancel: Cancelled,
        context: Context,
    ) -> GenerationResult:
        text, stopped = cut_at_stop(self._decode(ids), sampling.stop)
        if cancel.flag.is_set():
            reason = "cancelled"
        elif stopped or (ids and ids[-1] in eos_ids(self.model)):
            reason = "stop"
        else:
            reason = "length"
        return GenerationResult(
            text=text,
            token_ids=ids,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(tokens),
            reused_tokens=context.reused,
            recomputed_tokens=len(tokens) - context.reused,
            ttft_ms=0.0,
            total_ms=0.0,
            passages_hit=context.passages_hit,
            passages_missed=context.passages_missed,
        )

    def _remember(self, tokens: list[int], generated: list[int], context: Context) -> None:
        """Store the new exact blocks of the prompt (and the answer) for later requests.
        KV after the first reused passage is approximate and never enters the prefix cache."""
        stream = tokens + generated[:-1] if self.config.cache_generated else tokens
        exact = len(stream) if context.exact_upto is None else context.exact_upto
        upto = min(len(stream), context.cache.get_seq_length(), exact)
        self._prefix.insert(stream, context.cache, upto)
        if context.deferred:
            assert self._passages is not None
            self._passages.fetch(context.deferred, known=[None] * len(context.deferred))
