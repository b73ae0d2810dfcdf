"""The systems ``bench.load`` compares, each a callable that runs N requests at once on one
model and times them as a client sees them."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvboost_rag import KVBoost
from kvboost_rag.cli.timing import first_token_ms
from kvboost_rag.core.prompt.chunker import parse_segments

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Timed:
    """One request as a client saw it (``perf_counter`` readings)."""

    start: float
    first: float  # the first text delta (the end, for a system that cannot stream)
    end: float
    text: str
    tokens: int  # generated tokens (the engine's ids, EOS included; HF: the text re-tokenized)
    token_ids: list[int] | None  # the engine's ids; None for the pipeline


System = Callable[[list[Messages]], list[Timed]]


def engine_system(engine: KVBoost, max_new_tokens: int) -> System:
    """N requests on N threads, released together, each streamed."""

    def one(messages: Messages, barrier: threading.Barrier) -> Timed:
        barrier.wait()
        start = time.perf_counter()
        stream = engine.stream_chat(messages, max_new_tokens=max_new_tokens)
        ttft_ms, _ = first_token_ms(start, stream)
        end, result = time.perf_counter(), stream.result
        assert result is not None, "a drained stream holds its result"
        ids = list(result.token_ids)
        text = result.text
        return Timed(start, start + ttft_ms / 1e3, end, text, len(ids), ids)

    def run(batch: list[Messages]) -> list[Timed]:
        barrier = threading.Barrier(len(batch))
        with ThreadPoolExecutor(len(batch)) as pool:
            return list(pool.map(one, batch, [barrier] * len(batch)))

    run.engine = engine  # type: ignore[attr-defined]  # measure() reads its batch stats
    return run


def batch_delta(run: System, before: Any) -> dict[str, Any] | None:
    """What the engine's batcher did since ``before`` (its ``stats().batch`` then)."""
    engine = getattr(run, "engine", None)
    if engine is None:
        return None
    now = engine.stats().batch
    return {
        "steps": now.steps - before.steps,
        "rows": now.rows - before.rows,
        "seconds": now.seconds - before.seconds,
    }


def batch_before(run: System) -> Any:
    engine = getattr(run, "engine", None)
    return engine.stats().batch if engine is not None else None


def pipeline_system(base: KVBoost, max_new_tokens: int) -> System:
    """LangChain's ``HuggingFacePipeline.batch`` over all N prompts with ``batch_size=N``,
    on ``base``'s model and a copy of its tokenizer (the pipeline pads it on the left)."""
    from langchain_huggingface import HuggingFacePipeline
    from transformers import pipeline

    tokenizer = copy.deepcopy(base.tokenizer)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    def run(batch: list[Messages]) -> list[Timed]:
        pipe = pipeline(
            "text-generation",
            model=base.model,
            tokenizer=tokenizer,
            batch_size=len(batch),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            return_full_text=False,
        )
        llm = HuggingFacePipeline(pipeline=pipe, batch_size=len(batch))
        prompts: list[Any] = [plain_prompt(tokenizer, m) for m in batch]
        start = time.perf_counter()
        answers = llm.batch(prompts)
        end = time.perf_counter()
        counts = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers]
        return [Timed(start, end, end, a, n, None) for a, n in zip(answers, counts)]

    return run


def plain_prompt(tokenizer: Any, messages: Messages) -> str:
    """What ChatHuggingFace hands its pipeline: the chat template over the messages with
    the passage markers removed."""
    plain = [
        {**m, "content": "".join(s.text for s in parse_segments(m["content"]))} for m in messages
    ]
    return str(tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True))


def same(answer: Timed, serialized: Timed) -> bool:
    """Token ids where both have them (the engines), else the text."""
    if answer.token_ids is not None:
        return answer.token_ids == serialized.token_ids
    return answer.text.strip() == serialized.text.strip()
