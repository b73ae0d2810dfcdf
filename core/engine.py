"""The engine: tokenize, reuse cached KV, generate, store what is new."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StoppingCriteriaList

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.errors import ContextWindowError, EmptyPromptError
from kvboost_rag.core.fingerprint import model_fingerprint
from kvboost_rag.core.kv import concat_kv, to_cache
from kvboost_rag.core.loading import default_device, default_dtype, load_model, resolve_model_path
from kvboost_rag.core.prefix import PrefixCache
from kvboost_rag.core.result import GenerationResult, Timings
from kvboost_rag.core.sampling import SamplingOptions
from kvboost_rag.core.store import MemoryStore, StoreStats
from kvboost_rag.core.streaming import Cancelled, GenerationStream, TokenCollector, cut_at_stop

Message = dict[str, str]


@dataclass(frozen=True)
class WarmResult:
    tokens: int  # tokens in the warmed text
    cached_tokens: int  # of those, already cached before this call
    stored_blocks: int  # new blocks stored by this call


@dataclass(frozen=True)
class EngineStats:
    cache: StoreStats  # the KV store: size, entries, hits, misses, evictions
    requests: int  # completed generate/chat/stream calls
    prompt_tokens: int  # summed over requests
    reused_tokens: int  # prompt tokens served from cache, summed over requests


class KVBoost:
    """A model, its tokenizer and a KV cache that makes repeated context cheap.

    Safe to share between threads: requests run one at a time under the engine's lock
    (one forward pass already uses every core), so results equal serial calls.
    """

    def __init__(self, model: Any, tokenizer: Any, config: KVBoostConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or KVBoostConfig()
        self.fingerprint = model_fingerprint(model, tokenizer)
        self.context_window = int(model.config.max_position_embeddings)
        self._store = MemoryStore(self.config.max_cache_bytes)
        self._prefix = PrefixCache(self._store, self.fingerprint, self.config.block_tokens)
        self._lock = threading.RLock()
        self._requests = self._prompt_tokens = self._reused_tokens = 0

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
        return cls(hf_model, tokenizer, config)

    # -- public requests -------------------------------------------------------------

    def generate(self, prompt: str, **options: Any) -> GenerationResult:
        """Complete ``prompt``. Options: max_new_tokens, temperature, top_p, top_k, stop, seed."""
        start = time.perf_counter()
        sampling = SamplingOptions.build(**options)
        return self._run(self._prompt_ids(prompt), sampling, start, None, Cancelled())

    def chat(self, messages: Sequence[Message], **options: Any) -> GenerationResult:
        """Answer the last message of a conversation, using the tokenizer's chat template."""
        start = time.perf_counter()
        sampling = SamplingOptions.build(**options)
        return self._run(self._chat_ids(messages), sampling, start, None, Cancelled())

    def stream(self, prompt: str, **options: Any) -> GenerationStream:
        """Like ``generate`` but yields text deltas; ``.result`` is set when it ends."""
        start = time.perf_counter()
        sampling = SamplingOptions.build(**options)
        return self._stream(lambda: self._prompt_ids(prompt), sampling, start)

    def stream_chat(self, messages: Sequence[Message], **options: Any) -> GenerationStream:
        start = time.perf_counter()
        sampling = SamplingOptions.build(**options)
        return self._stream(lambda: self._chat_ids(messages), sampling, start)

    def warm(self, text: str) -> WarmResult:
        """Prefill ``text`` and cache it as an exact prefix of later prompts."""
        tokens = self._prompt_ids(text)
        with self._lock, torch.inference_mode():
            match = self._prefix.match(tokens)
            if match.length < len(tokens):
                cache = self._assemble(match.blocks)
                tail = torch.tensor([tokens[match.length :]], device=self.model.device)
                self.model(input_ids=tail, cache=cache, use_cache=True, logits_to_keep=1)
                stored = self._prefix.insert(tokens, cache, len(tokens))
            else:
                stored = 0
        return WarmResult(len(tokens), match.length, stored)

    def first_token_logits(self, prompt: str) -> torch.Tensor:
        """Next-token logits after ``prompt``, computed on the cached path (for fidelity
        checks against a full prefill of the same tokens). Stores nothing."""
        tokens = self._prompt_ids(prompt)
        with self._lock, torch.inference_mode():
            match = self._prefix.match(tokens)
            reused = min(match.length, len(tokens) - 1)
            cache = self._assemble(match.blocks, reused)
            tail = torch.tensor([tokens[reused:]], device=self.model.device)
            out = self.model(input_ids=tail, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                self._store.stats(), self._requests, self._prompt_tokens, self._reused_tokens
            )

    def clear_cache(self) -> None:
        self._store.clear()

    # -- tokenization ----------------------------------------------------------------

    def _prompt_ids(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt:
            raise EmptyPromptError("prompt is empty: pass the text to complete")
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def _chat_ids(self, messages: Sequence[Message]) -> list[int]:
        if not messages:
            raise EmptyPromptError("messages is empty: pass at least one {'role', 'content'} dict")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise ValueError(
                    f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}"
                )
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens; adding them again would double BOS.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_length(self, tokens: list[int]) -> None:
        if not tokens:
            raise EmptyPromptError("prompt has no tokens after tokenization")
        if len(tokens) >= self.context_window:
            raise ContextWindowError(len(tokens), self.context_window)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the request path ------------------------------------------------------------

    def _stream(
        self, prompt_ids: Callable[[], list[int]], sampling: SamplingOptions, start: float
    ) -> GenerationStream:
        ids = prompt_ids()  # tokenize and check in the caller's thread so bad input raises here
        self._check_length(ids)
        return GenerationStream(
            lambda on_token, cancel: self._run(ids, sampling, start, on_token, cancel),
            self._decode,
            sampling.stop,
        )

    def _run(
        self,
        tokens: list[int],
        sampling: SamplingOptions,
        start: float,
        on_token: Callable[[int], None] | None,
        cancel: Cancelled,
    ) -> GenerationResult:
        self._check_length(tokens)
        timings = Timings(tokenize_ms=_ms(start))
        with self._lock, torch.inference_mode():
            t = time.perf_counter()
            match = self._prefix.match(tokens)
            timings.lookup_ms = _ms(t)
            t = time.perf_counter()
            reused = min(match.length, len(tokens) - 1)  # generate needs one token to feed
            cache = self._assemble(match.blocks, reused)
            timings.assemble_ms = _ms(t)
            collector = TokenCollector(on_token)
            gen_start = time.perf_counter()
            self._generate(tokens, cache, sampling, collector, cancel)
            end = time.perf_counter()
            first = collector.first_token_at or end
            timings.prefill_ms = (first - gen_start) * 1e3
            timings.decode_ms = (end - first) * 1e3
            result = self._result(
                tokens, collector.token_ids, sampling, cancel, reused, start, first, timings
            )
            t = time.perf_counter()
            self._remember(tokens, collector.token_ids, cache)
            timings.store_ms = _ms(t)
            result.total_ms = _ms(start)
            self._requests += 1
            self._prompt_tokens += len(tokens)
            self._reused_tokens += reused
        return result

    def _assemble(self, blocks: list, length: int | None = None) -> Any:
        if not blocks:
            return to_cache([], self.model.config)
        kv = concat_kv(blocks)
        if length is not None:
            kv = [(k[:, :, :length], v[:, :, :length]) for k, v in kv]
        return to_cache(kv, self.model.config)

    def _generate(
        self,
        tokens: list[int],
        cache: Any,
        sampling: SamplingOptions,
        collector: TokenCollector,
        cancel: Cancelled,
    ) -> None:
        max_new = min(sampling.max_new_tokens, self.context_window - len(tokens))
        config = sampling.generation_config(self.model.generation_config, max_new)
        input_ids = torch.tensor([tokens], device=self.model.device)
        seeded = torch.random.fork_rng(devices=[]) if sampling.seed is not None else nullcontext()
        with seeded:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                cache=cache,
                streamer=collector,
                stopping_criteria=StoppingCriteriaList([cancel]),
                tokenizer=self.tokenizer,
            )

    def _result(
        self,
        tokens: list[int],
        ids: list[int],
        sampling: SamplingOptions,
        cancel: Cancelled,
        reused: int,
        start: float,
        first: float,
        timings: Timings,
    ) -> GenerationResult:
        text, stopped = cut_at_stop(self._decode(ids), sampling.stop)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        if cancel.flag.is_set():
            reason = "cancelled"
        elif stopped or (ids and ids[-1] in eos_ids):
            reason = "stop"
        else:
            reason = "length"
        return GenerationResult(
            text=text,
            token_ids=ids,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(tokens),
            reused_tokens=reused,
            recomputed_tokens=len(tokens) - reused,
            ttft_ms=(first - start) * 1e3,
            total_ms=0.0,
            timings=timings,
        )

    def _remember(self, tokens: list[int], generated: list[int], cache: Any) -> None:
        """Store the new full blocks of the prompt (and the answer) for later requests."""
        stream = tokens + generated[:-1] if self.config.cache_generated else tokens
        self._prefix.insert(stream, cache, min(len(stream), cache.get_seq_length()))


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3
