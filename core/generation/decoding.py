"""Decoding through transformers' ``generate`` on an assembled cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from kvboost_rag.core.generation.batching import Job
from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.generation.streaming import Cancelled, TokenCollector
from kvboost_rag.core.model.kv import layer_kv
from kvboost_rag.core.reuse.context import Context


class Decoded(NamedTuple):
    token_ids: list[int]
    started: float  # perf_counter when decoding began
    first_at: float  # ... when the first token was out (``ended`` if none was)
    ended: float


def generate_tokens(
    model: Any,
    tokenizer: Any,
    tokens: list[int],
    context: Context,
    sampling: SamplingOptions,
    on_token: Callable[[int], None] | None,
    cancel: Cancelled,
    window: int,
    processors: LogitsProcessorList | None = None,
) -> Decoded:
    """Decode after ``tokens``, at most up to a ``window``-token context, timing the first
    token."""
    collector = TokenCollector(on_token)
    started = time.perf_counter()
    max_new = min(sampling.max_new_tokens, window - len(tokens))
    decode(model, tokenizer, tokens, context, sampling, max_new, collector, cancel, processors)
    ended = time.perf_counter()
    return Decoded(collector.token_ids, started, collector.first_token_at or ended, ended)


def decode(
    model: Any,
    tokenizer: Any,
    tokens: list[int],
    context: Context,
    sampling: SamplingOptions,
    max_new: int,
    collector: TokenCollector,
    cancel: Cancelled,
    processors: LogitsProcessorList | None = None,
) -> None:
    """Generate up to ``max_new`` tokens after ``tokens``. When the repair pass already
    computed the prompt's last position, its logits give the first token directly and
    generate continues from there (saving a forward pass before the first token).
    ``processors`` (a grammar's mask) apply to every token, the first one included."""
    processors = processors or LogitsProcessorList()
    seeded = torch.random.fork_rng(devices=[]) if sampling.seed is not None else nullcontext()
    with seeded:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        if context.logits is not None:
            config = sampling.generation_config(model.generation_config, max_new)
            first = first_token(model, config, tokens, context.logits, processors)
            collector.put(torch.tensor(tokens))  # the prompt, skipped by the collector
            collector.put(torch.tensor([first]))
            if max_new == 1 or first in eos_ids(model):
                return
            tokens, max_new = [*tokens, first], max_new - 1
            collector.expect_prompt()
        input_ids = torch.tensor([tokens], device=model.device)
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=sampling.generation_config(model.generation_config, max_new),
            cache=context.cache,
            streamer=collector,
            stopping_criteria=StoppingCriteriaList([cancel]),
            logits_processor=processors,
            tokenizer=tokenizer,
        )


def open_job(
    model: Any,
    tokenizer: Any,
    tokens: list[int],
    context: Context,
    sampling: SamplingOptions,
    collector: TokenCollector,
    cancel: Cancelled,
    window: int,
    processors: LogitsProcessorList,
    limit: int,
) -> Job:
    """A request's decoding up to its first token, for a ``Batcher`` to go on with: the
    prompt's last positions when the context lacks them, then the first token. Run under
    the model lock. The job is ``done`` already when that token ends the request."""
    max_new = min(sampling.max_new_tokens, window - len(tokens))
    config = sampling.generation_config(model.generation_config, max_new)
    generator = None
    if sampling.seed is not None:  # the stream a seeded ``generate`` would draw from
        generator = torch.Generator(device=model.device).manual_seed(sampling.seed)
    logits, cache = context.logits, context.cache
    if logits is None:
        ids = torch.tensor([tokens[cache.get_seq_length() :]], device=model.device)
        logits = model(input_ids=ids, cache=cache, logits_to_keep=1).logits[0, -1]
    config.max_length = len(tokens) + max_new  # what generate sets from max_new_tokens
    job = Job(
        tokens=list(tokens),
        kv=layer_kv(cache),
        do_sample=bool(config.do_sample),
        processors=generate_processors(model, config, tokens, processors),
        stopping=model._get_stopping_criteria(
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([cancel]),
            tokenizer=tokenizer,
        ),
        generator=generator,
        collector=collector,
        cancel=cancel,
        limit=limit,
    )
    collector.put(torch.tensor(tokens))  # the prompt, skipped by the collector
    if job.choose(logits.to(torch.float32)):
        job.done.set()
    return job


def first_token(
    model: Any,
    config: GenerationConfig,
    tokens: list[int],
    logits: torch.Tensor,
    extra: LogitsProcessorList | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """The token ``generate`` would pick after ``tokens`` from these next-token logits: the
    logits processors it builds from the same generation config (repetition_penalty,
    min_p, temperature, top-k/p, ...) in its order, then argmax or one multinomial draw,
    so seeded runs agree with a plain ``generate``. ``config`` is prepared in place: pass
    a copy (``SamplingOptions.generation_config`` makes one)."""
    processors = generate_processors(model, config, tokens, extra)
    ids = torch.tensor([tokens], device=model.device)
    scores = processors(ids, logits.to(dtype=torch.float32, device=ids.device)[None])  # type: ignore[arg-type]
    if config.do_sample:
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=generator))
    return int(scores.argmax())


def generate_processors(
    model: Any, config: GenerationConfig, tokens: list[int], extra: LogitsProcessorList | None
) -> LogitsProcessorList:
    """The logits processors ``generate`` builds from ``config`` (prepared in place) for a
    prompt of ``tokens``, ``extra`` merged in."""
    ids = torch.tensor([tokens], device=model.device)
    # transformers has no public builder for generate's processors; these two private
    # methods are what generate itself calls (pinned by tests/reuse/test_passage_reuse.py's
    # test_first_token_follows_the_model_generation_config).
    model._prepare_special_tokens(config, True, device=model.device)
    return model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=len(tokens),
        encoder_input_ids=ids,
        logits_processor=extra or LogitsProcessorList(),
        device=model.device,
        model_kwargs={},
    )


def eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> threading.RLock:
    """One lock per model object: engines sharing a model must not interleave forwards
    (a repair probe switches the model's attention implementation for one call)."""
    with _LOCKS_GUARD:
        lock = getattr(model, "_kvboost_lock", None)
        if lock is None:
            lock = threading.RLock()
            model._kvboost_lock = lock
        return lock
