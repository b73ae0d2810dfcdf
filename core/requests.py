"""One engine's side of a request: a validated, tokenized prompt becomes a ``Request`` (what
the caches hold for it, its plan, its sampler), the executor builds and stores through it,
and an ended request becomes the caller's ``GenerationResult``.

The engine (``core/engine.py``) validates and tokenizes; this is what it hands the request
to. It is the ``Owner`` the executor asks (``generation/request.py``), since one executor
serves every engine on a model and each engine has caches of its own.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from transformers import LogitsProcessorList, StopStringCriteria

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.generation.handle import ModelHandle
from kvboost_rag.core.generation.request import Request
from kvboost_rag.core.generation.sampler import Sampler
from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.generation.speculation import PromptLookup
from kvboost_rag.core.generation.streaming import complete, cut_at_stop
from kvboost_rag.core.prompt.chunker import TokenizedPrompt
from kvboost_rag.core.results import GenerationResult, Timings
from kvboost_rag.core.reuse.assemble import RowKV
from kvboost_rag.core.reuse.caches import Caches
from kvboost_rag.core.reuse.context import Context
from kvboost_rag.core.tools.structure import Constrainer, Structure
from kvboost_rag.core.tools.written import WrittenCalls

# Stop-string matchers kept, one per distinct set of stops; the oldest goes first.
MAX_STOP_SETS = 64


class Requests:
    """The engine's requests: ``open`` makes them (on callers' threads); the executor
    builds and stores through them and ends them (on its thread). Thread-safe."""

    def __init__(
        self,
        handle: ModelHandle,
        tokenizer: Any,
        config: KVBoostConfig,
        caches: Caches,
        written: WrittenCalls | None = None,
    ) -> None:
        self.handle = handle
        self.written = written  # answers that made calls, kept to render them as written
        self.tokenizer = tokenizer
        self.config = config
        self.caches = caches
        self.batch_size = config.batch_size(handle.device)
        self.kv_budget = config.kv_budget(handle.device)
        self.constrainer = Constrainer(tokenizer, sorted(handle.eos))
        self._requests = self._prompt_tokens = self._reused_tokens = 0
        self._counting = threading.Lock()  # the three counters, read together
        self._stops: OrderedDict[tuple[str, ...], StopStringCriteria] = OrderedDict()
        self._stopping = threading.Lock()

    def counts(self) -> tuple[int, int, int]:
        """Requests answered, their prompt tokens and the tokens of those reused."""
        with self._counting:
            return self._requests, self._prompt_tokens, self._reused_tokens

    def check_stops(self, stops: tuple[str, ...]) -> None:
        """Stop strings the tokenizer cannot write could never end an answer, and
        transformers refuses them mid-request: refuse them here, before the model runs."""
        self.stop_criteria(stops)

    def stop_criteria(self, stops: tuple[str, ...]) -> StopStringCriteria | None:
        """The matcher for ``stops``, built once per distinct set: building one reads the
        whole vocabulary (0.5-1 s on Qwen2.5's 151k tokens, issue 64), and it holds no
        state of a request's, so every request with these stops shares it."""
        if not stops:
            return None
        with self._stopping:
            built = self._stops.get(stops)
            if built is not None:
                self._stops.move_to_end(stops)
                return built
        try:
            built = StopStringCriteria(self.tokenizer, list(stops))
        except ValueError as error:
            raise ValueError(
                f"stop strings {list(stops)!r} cannot be written with this tokenizer's "
                "vocabulary, so they could never end an answer; pass text the model can write"
            ) from error
        with self._stopping:
            self._stops[stops] = built
            while len(self._stops) > MAX_STOP_SETS:
                self._stops.popitem(last=False)
        return built

    # -- on the caller's thread ----------------------------------------------------------

    def open(
        self,
        prompt: TokenizedPrompt,
        sampling: SamplingOptions,
        structure: Structure,
        start: float,
        feed: list[int] | None = None,
        stream: Callable[[Request], object] | None = None,
    ) -> Request:
        """Look up what the caches hold for ``prompt``, plan on it and hand the request to
        the model's executor: without ``stream``, return once it has ended (``wait``
        gives its result). ``feed``: a logits-only request (tokens fed after the prompt).
        ``stream`` attaches a stream's hand-offs before the executor runs it."""
        timings = Timings(tokenize_ms=(time.perf_counter() - start) * 1e3)
        with timings.stage("lookup"):
            lookup = self.caches.look_up(prompt)
        cancel = threading.Event()
        request = Request(
            prompt=prompt,
            sampling=sampling,
            owner=self,
            sampler=self._sampler(prompt, sampling, structure, cancel),
            structure=structure,
            limit=self.batch_size,
            kv_budget=self.kv_budget,
            packed=self.config.packed_head,
            compiled=self.config.compiled_step != "off",
            start=start,
            timings=timings,
            lookup=lookup,
            plan=self.caches.plan(prompt.tokens, lookup),
            cancel=cancel,
            feed=feed,
        )
        drafts = sampling.draft_tokens
        if drafts is None and self.config.draft_tokens is None and not sampling.greedy:
            # The device default drafts for greedy requests only: a sampled one drafted
            # alone draws from its generator differently than one decoding beside others,
            # and a seed must give one answer however many requests run together.
            drafts = 0
        drafts = self.config.draft_length(self.handle.device) if drafts is None else drafts
        if drafts and feed is None:
            request.drafter = PromptLookup(prompt.tokens, drafts)
        if stream is None:  # the caller waits for the answer: it may run the loop itself
            self.handle.executor.run(request)
        else:
            stream(request)
            self.handle.executor.submit(request)
        return request

    def _sampler(
        self,
        prompt: TokenizedPrompt,
        sampling: SamplingOptions,
        structure: Structure,
        cancel: threading.Event,
    ) -> Sampler:
        grammar = structure.grammar(self.constrainer.special)
        try:
            extra = LogitsProcessorList(
                [self.constrainer.processor(grammar)] if grammar is not None else []
            )
        except ValueError as error:  # named, so a server can say which field it was
            field = "tools" if structure.tools else "response_format"
            raise ValueError(f"{field}: {error}") from error
        max_new = min(sampling.max_new_tokens, self.handle.context_window - len(prompt.tokens))
        model = self.handle.model
        stops = self.stop_criteria(sampling.stop)
        return Sampler(
            model, self.tokenizer, sampling, len(prompt.tokens), max_new, cancel, extra, stops
        )

    # -- on the executor's thread (the Owner protocol) -----------------------------------

    def build(self, request: Request, row: RowKV) -> Context:
        return self.caches.build(request.plan, request.lookup, row, request.timings)

    def finished(self, request: Request, row: RowKV) -> None:
        if request.feed is not None or request.error is not None:
            return  # a fidelity check stores no prefix
        self.caches.remember(request.plan, request.generated, row, self.handle.executor.post)

    def result(self, request: Request) -> GenerationResult:
        """What the caller gets once ``request`` has ended."""
        ids = request.generated if request.feed is None else []
        text, stopped = cut_at_stop(self.decode(ids), request.sampling.stop)
        text = complete(text)  # an answer cut inside a character ends before it
        plan, context = request.plan, request.context
        reused = context.reused if context is not None else 0
        # No context (a request that ended before its KV was built): the cache's passages
        # were found, not used.
        hits = context.passages_hit if context is not None else 0
        unused = context.passages_unused if context is not None else plan.hits
        first = request.first_at or request.ended_at or time.perf_counter()
        ended = request.ended_at or first
        request.timings.decode_ms = (ended - first) * 1e3
        parsed = request.structure.parse(text)
        if parsed.calls and self.written is not None:
            self.written.remember(text, parsed.content, parsed.calls)
        reason = self._finish_reason(request, ids, stopped)
        if request.feed is None:
            with self._counting:
                self._requests += 1
                self._prompt_tokens += len(plan.tokens)
                self._reused_tokens += reused
        return GenerationResult(
            text=parsed.content,
            token_ids=ids,
            finish_reason="tool_calls" if parsed.calls and reason == "stop" else reason,  # type: ignore[arg-type]
            prompt_tokens=len(plan.tokens),
            reused_tokens=reused,
            recomputed_tokens=len(plan.tokens) - reused,
            ttft_ms=(first - request.start) * 1e3,
            total_ms=(ended - request.start) * 1e3,
            timings=request.timings,
            passages_hit=hits,
            passages_missed=len(plan.passages) - hits - unused,
            passages_unused=unused,
            passages_foreign=context.passages_foreign if context is not None else 0,
            reuse_reason=f"{plan.route}: {plan.why}",
            tool_calls=parsed.calls,
            invalid_tool_calls=parsed.invalid,
        )

    def _finish_reason(self, request: Request, ids: list[int], stopped: bool) -> str:
        if request.cancel.is_set():
            return "cancelled"
        if stopped or (ids and ids[-1] in self.handle.eos):
            return "stop"
        return "length"

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
