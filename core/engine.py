"""The engine: tokenize, plan what to reuse, build the cache, generate, store what is new.

One request reads top to bottom in ``_run``: ``make_plan`` (pure) -> ``build_context``
(exact prefix, assembled passages, repair) -> ``decode`` (transformers' generate) ->
``_remember`` (new exact prefix blocks, passages a cold prompt deferred) -> one result.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvboost_rag.core.arch import model_support
from kvboost_rag.core.chunker import TokenizedPrompt
from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.context import Context, build_context
from kvboost_rag.core.decoding import Decoded, eos_ids, generate_tokens, model_lock
from kvboost_rag.core.disk import DiskStore
from kvboost_rag.core.fingerprint import model_fingerprint
from kvboost_rag.core.kv import LayerKV, blocks_cache, kv_nbytes, layer_kv
from kvboost_rag.core.loading import default_device, default_dtype, load_model, resolve_model_path
from kvboost_rag.core.passages import PassageCache
from kvboost_rag.core.plan import Plan, make_plan
from kvboost_rag.core.prefix import PrefixCache
from kvboost_rag.core.prompts import Message, PromptEncoder, anchor_tokens
from kvboost_rag.core.result import EngineStats, GenerationResult, Timings, WarmResult, elapsed_ms
from kvboost_rag.core.reuse import PassageReuse
from kvboost_rag.core.sampling import SamplingOptions
from kvboost_rag.core.streaming import Cancelled, GenerationStream, cut_at_stop
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
        self.support = model_support(model)
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
        self._reuse = self._passage_reuse()
        self._lock = model_lock(model)
        self._requests = self._prompt_tokens = self._reused_tokens = 0

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
            self._store, self.model, self.fingerprint, anchor, self.config.encode_batch_tokens
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
        start = time.perf_counter()
        tokens = self._prompts.text(text).tokens
        with self._lock, torch.inference_mode():
            match = self._prefix.match(tokens)
            cache = blocks_cache(match.blocks, self.model.config, match.length)
            new = 0
            if match.length < len(tokens):
                tail = torch.tensor([tokens[match.length :]], device=self.model.device)
                self.model(input_ids=tail, cache=cache, use_cache=True, logits_to_keep=1)
                new = self._prefix.insert(tokens, cache, len(tokens))
            size = kv_nbytes(layer_kv(cache))
        blocks = -(-len(tokens) // self.config.block_tokens)
        cached = -(-match.length // self.config.block_tokens)
        return WarmResult(1, blocks, len(tokens), cached, new, size, time.perf_counter() - start)

    def warm_passages(
        self,
        texts: Sequence[str] | str,
        *,
        batch_size: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> WarmResult:
        """Encode and cache passages so later prompts that contain them reuse their KV
        (written through to ``cache_dir`` when set).

        Each text of a list is one passage (long ones split at sentences, as in prompts);
        a single string is a prompt whose ``passage()``-marked passages are warmed.
        ``batch_size`` caps the passages per forward pass (default: by padded tokens).
        ``progress`` is called with the number of pieces done as batches finish. Returns
        once the KV is on disk too.
        """
        if self._reuse is None:
            why = 'fidelity="exact"' if self.config.fidelity == "exact" else self.support.reason
            raise ValueError(f"passage reuse is off ({why}): there are no passages to warm")
        start = time.perf_counter()
        pieces = self._prompts.passages(texts)
        with self._lock, torch.inference_mode():
            found = self._reuse.cache.fetch(pieces, batch_size=batch_size, progress=progress)
            self._store.flush()  # warmed means on disk, for every process
        documents = 1 if isinstance(texts, str) else len(texts)
        return WarmResult(
            documents,
            len(pieces),
            sum(map(len, pieces)),
            found.hits,
            found.misses,
            sum(kv_nbytes(kv) for kv in found.kv),
            time.perf_counter() - start,
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
            plan, blocks = self._plan(tokenized)
            context = build_context(self.model, plan, blocks, self._reuse, Timings())
            if context.logits is not None:
                return context.logits.float()
            rest = torch.tensor([plan.tokens[plan.exact :]], device=self.model.device)
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

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the request path ------------------------------------------------------------

    def _stream(
        self, prompt: TokenizedPrompt, sampling: SamplingOptions, start: float
    ) -> GenerationStream:
        return GenerationStream(
            lambda on_token, cancel: self._run(prompt, sampling, start, on_token, cancel),
            self._decode_text,
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
        with self._lock, torch.inference_mode():
            with timings.stage("lookup"):
                plan, blocks = self._plan(prompt)
            context = build_context(self.model, plan, blocks, self._reuse, timings)
            decoded = generate_tokens(
                self.model,
                self.tokenizer,
                plan.tokens,
                context,
                sampling,
                on_token,
                cancel,
                self.context_window,
            )
            with timings.stage("store"):
                self._remember(plan, context, decoded.token_ids)
            self._requests += 1
            self._prompt_tokens += len(plan.tokens)
            self._reused_tokens += context.reused
        return self._result(plan, context, decoded, sampling, cancel, timings, start)

    def _plan(self, prompt: TokenizedPrompt) -> tuple[Plan, list[LayerKV]]:
        match = self._prefix.match(prompt.tokens)
        is_cached = self._reuse.is_cached if self._reuse is not None else None
        return make_plan(prompt, match.length, is_cached), match.blocks

    def _remember(self, plan: Plan, context: Context, generated: list[int]) -> None:
        """Store the new exact blocks of the prompt (and the answer) for later requests, and
        encode the passages a cold prompt deferred. KV after the first reused passage is
        approximate and never enters the prefix cache."""
        stream = plan.tokens + generated[:-1] if self.config.cache_generated else plan.tokens
        exact = len(stream) if plan.exact_upto is None else plan.exact_upto
        upto = min(len(stream), context.cache.get_seq_length(), exact)
        self._prefix.insert(stream, context.cache, upto)
        if plan.deferred:
            assert self._reuse is not None  # only a passage plan defers passages
            self._reuse.cache.fetch(plan.deferred, known=[None] * len(plan.deferred))

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
            passages_hit=plan.hits,
            passages_missed=plan.misses,
        )
