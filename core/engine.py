"""The engine: tokenize, plan what to reuse, build the cache, generate, store what is new.

One request reads top to bottom in ``_run``: ``make_plan`` (pure) -> ``build_context``
(exact prefix, assembled passages, repair) -> ``decode`` (transformers' generate) ->
``_remember`` (new exact prefix blocks, passages a cold prompt deferred) -> one result.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from transformers import LogitsProcessorList

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.generation.batching import model_batcher
from kvboost_rag.core.generation.decoding import (
    Decoded,
    eos_ids,
    generate_tokens,
    model_lock,
    open_job,
)
from kvboost_rag.core.generation.requests import Requests
from kvboost_rag.core.generation.result import EngineStats, GenerationResult, Timings, elapsed_ms
from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.generation.streaming import (
    Cancelled,
    GenerationStream,
    TokenCollector,
    cut_at_stop,
)
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.fingerprint import model_fingerprint
from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.model.loading import (
    default_device,
    default_dtype,
    load_model,
    resolve_model_path,
)
from kvboost_rag.core.prompt.chunker import TokenizedPrompt
from kvboost_rag.core.prompt.prompts import Message, PromptEncoder, anchor_tokens, before_passages
from kvboost_rag.core.reuse.assemble import PassageReuse
from kvboost_rag.core.reuse.context import Context, build_context
from kvboost_rag.core.reuse.passage_encoder import PassageEncoder
from kvboost_rag.core.reuse.passages import PassageCache
from kvboost_rag.core.reuse.plan import Plan, make_plan
from kvboost_rag.core.reuse.prefix import PrefixCache
from kvboost_rag.core.reuse.session import SessionCache
from kvboost_rag.core.store.tiers import open_tiers
from kvboost_rag.core.tools.structure import Constrainer, Structure
from kvboost_rag.core.warming import Warming


class KVBoost(Requests, Warming):
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
        self.support = model_support(model)
        self._prompts = PromptEncoder(
            tokenizer, self.context_window, self.config.max_passage_tokens
        )
        self._store = open_tiers(self.config, self.fingerprint)
        self._prefix = PrefixCache(self._store, self.fingerprint, self.config.block_tokens)
        self._reuse = self._passage_reuse()
        # An agent's or a conversation's next request extends this one: the KV it used
        # after its first reused passage (approximate, so never in the exact prefix cache)
        # is kept under a key space of its own, per repair setting, and continued from.
        self._session = (
            SessionCache(
                self._store,
                self.fingerprint,
                self.config.block_tokens,
                repr(self.config.repair_settings()),
            )
            if self._reuse is not None
            else None
        )
        self._lock = model_lock(model)
        self._batcher = model_batcher(model, self._lock)
        self._batch_size = self.config.batch_size(torch.device(model.device))
        self._constrainer = Constrainer(tokenizer, sorted(eos_ids(model)))
        self._requests = self._prompt_tokens = self._reused_tokens = 0
        self._counting = threading.Lock()  # the three counters, read together by stats()

    def _passage_reuse(self) -> PassageReuse | None:
        settings = self.config.repair_settings()
        if settings is None:  # fidelity "exact"
            return None
        if not self.support.passage_reuse:
            warnings.warn(f"{self.support.reason}; using exact prefix reuse only", stacklevel=3)
            return None
        anchor = (
            anchor_tokens(self.tokenizer, self._prompts.special_prefix)
            if self.config.passage_anchor
            else []
        )
        cache = PassageCache(
            self._store,
            PassageEncoder(self.model, self.config.encode_batch_tokens),
            self.fingerprint,
            anchor,
            nearest=self.config.prefix_fallback == "nearest",
        )
        return PassageReuse(self.model, cache, self.support, settings)

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

    @staticmethod
    def of(target: Any) -> KVBoost:
        """``target`` if it is an engine, else the engine it holds as ``.engine`` (the
        package's LangChain and LlamaIndex classes). Raises ``TypeError`` otherwise."""
        engine = target if isinstance(target, KVBoost) else getattr(target, "engine", None)
        if not isinstance(engine, KVBoost):
            raise TypeError(
                "expected a KVBoost engine or an object holding one as .engine (ChatKVBoost, "
                f"KVBoostLLM), got {type(target).__name__}"
            )
        return engine

    # -- public requests -------------------------------------------------------------

    def first_token_logits(
        self, prompt: str | Sequence[Message], *, passages: Sequence[str] | None = None
    ) -> torch.Tensor:
        """Next-token logits after ``prompt`` (text, or chat messages), computed on the same
        cached path as ``generate`` / ``chat``, for fidelity checks against a full prefill.
        Stores no prefix; passages it encodes are cached, as in ``generate``."""
        return self._prompt_logits(self._tokenized(prompt, passages), [])[0]

    def answer_logits(
        self,
        prompt: str | Sequence[Message],
        answer_ids: Sequence[int],
        *,
        passages: Sequence[str] | None = None,
    ) -> torch.Tensor:
        """``[len(answer_ids), vocab]`` float32 logits predicting each answer token, fed
        the answer before it (teacher forcing), on the same cached path as ``generate``:
        to compare a whole answer's distributions with a full prefill's."""
        if not answer_ids:
            raise ValueError("answer_ids is empty: pass the answer's token ids")
        return self._prompt_logits(self._tokenized(prompt, passages), list(answer_ids[:-1]))

    def _tokenized(
        self, prompt: str | Sequence[Message], passages: Sequence[str] | None
    ) -> TokenizedPrompt:
        if isinstance(prompt, str):
            return self._prompts.text(prompt, passages)
        return self._prompts.chat(prompt)

    def _prompt_logits(self, prompt: TokenizedPrompt, more: list[int]) -> torch.Tensor:
        """Logits after the prompt and after each token of ``more`` fed behind it."""
        with self._working():
            plan, blocks = self._plan(prompt)
            context = build_context(self.model, plan, blocks, self._reuse, Timings())
            rows = [context.logits[None]] if context.logits is not None else []
            feed = more if rows else plan.tokens[plan.exact :] + more
            if feed:
                ids = torch.tensor([feed], device=self.model.device)
                keep = len(more) + (0 if rows else 1)
                out = self.model(input_ids=ids, cache=context.cache, logits_to_keep=keep)
                rows.append(out.logits[0])
        return torch.cat(rows).float()

    def stats(self) -> EngineStats:
        """A snapshot; it does not wait for requests in flight (the tiers lock their own)."""
        tiers = self._store.stats()
        with self._counting:
            counts = self._requests, self._prompt_tokens, self._reused_tokens
        return EngineStats(tiers.memory, tiers.disk, *counts, tiers.remote, self._batcher.stats())

    def flush(self) -> None:
        """Wait until queued disk and shared-tier writes are made (requests queue them in
        the background; ``warm_passages`` / ``warm_corpus`` already wait). Raises
        ``OSError`` for a disk write that failed; shared-tier failures are warnings."""
        self._store.flush()

    def clear_cache(self) -> None:
        self._store.clear()

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the request path ------------------------------------------------------------

    def _stream(
        self,
        prompt: TokenizedPrompt,
        sampling: SamplingOptions,
        structure: Structure,
        start: float,
    ) -> GenerationStream:
        return GenerationStream(
            lambda on_token, cancel: self._run(
                prompt, sampling, structure, start, on_token, cancel
            ),
            self._decode_text,
            sampling.stop,
            structure.visible,
        )

    def _run(
        self,
        prompt: TokenizedPrompt,
        sampling: SamplingOptions,
        structure: Structure,
        start: float,
        on_token: Callable[[int], None] | None,
        cancel: Cancelled,
    ) -> GenerationResult:
        grammar = structure.grammar()
        processors = LogitsProcessorList(
            [self._constrainer.processor(grammar)] if grammar is not None else []
        )
        timings = Timings(tokenize_ms=elapsed_ms(start))
        with self._working():
            with timings.stage("lookup"):
                plan, blocks = self._plan(prompt)
            context = build_context(self.model, plan, blocks, self._reuse, timings)
            if self._batch_size == 1:
                decoded = generate_tokens(
                    self.model,
                    self.tokenizer,
                    plan.tokens,
                    context,
                    sampling,
                    on_token,
                    cancel,
                    self.context_window,
                    processors,
                )
            else:
                collector, started = TokenCollector(on_token), time.perf_counter()
                job = open_job(
                    self.model,
                    self.tokenizer,
                    plan.tokens,
                    context,
                    sampling,
                    collector,
                    cancel,
                    self.context_window,
                    processors,
                    self._batch_size,
                )
        if self._batch_size != 1:
            if not job.done.is_set():
                self._batcher.submit(job)
            job.wait()
            ended = time.perf_counter()
            first = collector.first_token_at or ended
            decoded = Decoded(collector.token_ids, started, first, ended)
            context = replace(context, cache=job.cache(self.model.config))
        with self._working():
            with timings.stage("store"):
                self._remember(plan, context, decoded.token_ids)
        with self._counting:
            self._requests += 1
            self._prompt_tokens += len(plan.tokens)
            self._reused_tokens += context.reused
        result = self._result(plan, context, decoded, sampling, cancel, timings, start)
        parsed = structure.parse(result.text)
        result.text = parsed.content
        result.tool_calls, result.invalid_tool_calls = parsed.calls, parsed.invalid
        if parsed.calls and result.finish_reason == "stop":
            result.finish_reason = "tool_calls"
        return result

    @contextmanager
    def _working(self) -> Iterator[None]:
        """The model lock, with decoding steps held back meanwhile (see ``Batcher``)."""
        with self._batcher.priority(), self._lock, torch.inference_mode():
            yield

    def _plan(self, prompt: TokenizedPrompt) -> tuple[Plan, list[LayerKV]]:
        match = self._prefix.match(prompt.tokens)
        matched, blocks, approx = match.length, match.blocks, None
        more = self._session.match(prompt.tokens, match.length) if self._session else None
        if more is not None:
            first = match.length // self.config.block_tokens
            matched, blocks, approx = more.length, blocks[:first] + more.blocks, match.length
        if self._reuse is None or not prompt.passages:
            return make_plan(prompt, matched, None, None, approx), blocks
        own = before_passages(prompt) if self.config.passage_prefix == "prompt" else []
        prefix = self._reuse.cache.prefix(own)
        locate = self._reuse.cache.locator(prefix)
        return make_plan(prompt, matched, prefix, locate, approx), blocks

    def _remember(self, plan: Plan, context: Context, generated: list[int]) -> None:
        """Store the new exact blocks of the prompt (and the answer) for later requests, and
        encode the passages a cold prompt deferred. KV after the first reused passage is
        approximate and never enters the prefix cache."""
        stream = plan.tokens + generated[:-1] if self.config.cache_generated else plan.tokens
        exact = len(stream) if plan.exact_upto is None else plan.exact_upto
        known = min(len(stream), context.cache.get_seq_length())
        self._prefix.insert(stream, context.cache, min(known, exact))
        if self._session is not None and exact < known:
            self._session.insert(stream, len(plan.tokens), context.cache, known, exact)
        if self._reuse is None or plan.prefix is None:
            return
        # A recurring layout gets its own variants of the passages it had to borrow.
        borrowed = plan.foreign_passages if self._reuse.cache.recurring(plan.prefix) else []
        if plan.deferred or borrowed:
            encode = plan.deferred + borrowed
            self._reuse.cache.fetch(plan.prefix, encode, [None] * len(encode))

    def _result(
        self,
        plan: Plan,
        context: Context,
        decoded: Decoded,
        sampling: SamplingOptions,
        cancel: Cancelled,
        timings: Timings,
        start: float,
    ) -> GenerationResult:
        ids = decoded.token_ids
        text, stopped = cut_at_stop(self._decode_text(ids), sampling.stop)
        if cancel.flag.is_set():
            reason = "cancelled"
        elif stopped or (ids and ids[-1] in eos_ids(self.model)):
            reason = "stop"
        else:
            reason = "length"
        hits = plan.hits if context.passages_hit is None else context.passages_hit
        timings.prefill_ms = (decoded.first_at - decoded.started) * 1e3
        timings.decode_ms = (decoded.ended - decoded.first_at) * 1e3
        return GenerationResult(
            text=text,
            token_ids=ids,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(plan.tokens),
            reused_tokens=context.reused,
            recomputed_tokens=len(plan.tokens) - context.reused,
            ttft_ms=(decoded.first_at - start) * 1e3,
            total_ms=elapsed_ms(start),
            timings=timings,
            passages_hit=hits,
            passages_missed=len(plan.passages) - hits,
            passages_foreign=plan.foreign,
        )
