"""Continuous batching: concurrent requests decode together and answer as if alone."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from batching_setup import ask, engines, prompts, together

from kvboost_rag import KVBoostConfig
from kvboost_rag.core.generation import batch as batch_module
from kvboost_rag.core.generation import executor as executor_module
from kvboost_rag.core.generation import sampler as sampler_module
from kvboost_rag.core.generation import slots as slots_module


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize("fidelity", ["exact", "balanced"])
def test_batched_answers_equal_serial_answers(arch: str, fidelity: str, tokenizer: Any) -> None:
    batched, serial = engines(arch, tokenizer, fidelity=fidelity)
    work = prompts(8)
    if fidelity != "exact":  # passages come from the cache, as after warm_corpus
        for engine in (batched, serial):
            engine.warm_passages([p for _, passages, _ in work for p in passages])
    want = [ask(serial, *w) for w in work]
    got = together([lambda w=w: ask(batched, *w) for w in work])
    assert got == want
    stats = batched.stats().batch
    assert stats is not None and stats.peak > 1, "the requests never decoded together"
    assert batched.stats().requests == 8


@pytest.mark.parametrize("fidelity", ["exact", "balanced"])
@pytest.mark.parametrize(
    "fill_tokens, fill_rows",
    [
        (7, {"cpu": 1}),
        (7, {}),
        (10_000, {}),
    ],  # chunked one row a turn, chunked rows together, whole rows together
)
def test_every_fill_schedule_gives_the_serial_answers(
    fidelity: str,
    fill_tokens: int,
    fill_rows: dict[str, int],
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(batch_module, "FILL_TOKENS", fill_tokens)
    monkeypatch.setattr(batch_module, "FILL_ROWS", fill_rows)
    batched, serial = engines("llama", tokenizer, fidelity=fidelity)
    work = prompts(6)
    if fidelity != "exact":
        for engine in (batched, serial):
            engine.warm_passages([p for _, passages, _ in work for p in passages])
    want = [ask(serial, *w) for w in work]
    assert together([lambda w=w: ask(batched, *w) for w in work]) == want
    stats = batched.stats().batch
    assert stats is not None and stats.peak > 1, "the requests never decoded together"


def test_seeded_sampling_equals_serial(tokenizer: Any) -> None:
    batched, serial = engines("llama", tokenizer)
    work = prompts(6)
    options = dict(temperature=0.9, top_k=20, seed=7)
    want = [ask(serial, *w, **options) for w in work]
    got = together([lambda w=w: ask(batched, *w, **options) for w in work])
    assert got == want


def test_stop_strings_and_streams_in_a_batch(tokenizer: Any) -> None:
    batched, serial = engines("llama", tokenizer)
    work = prompts(6)
    free = [serial.generate(q, passages=p, max_new_tokens=n).text for q, p, n in work]
    stops = [text[3:5] if len(text) > 5 else "\x00" for text in free]
    want = [
        serial.generate(q, passages=p, max_new_tokens=n, stop=s).text
        for (q, p, n), s in zip(work, stops)
    ]

    def streamed(i: int) -> str:
        q, p, n = work[i]
        return "".join(batched.stream(q, passages=p, max_new_tokens=n, stop=stops[i]))

    got = together([lambda i=i: streamed(i) for i in range(len(work))])
    assert got == want


def test_a_cancelled_stream_leaves_the_others_correct(tokenizer: Any) -> None:
    batched, serial = engines("llama", tokenizer)
    work = prompts(5)
    want = [ask(serial, *w) for w in work[1:]]
    seen: list[str] = []

    def cancelled() -> str:
        q, p, _ = work[0]
        stream = batched.stream(q, passages=p, max_new_tokens=200)
        for delta in stream:
            seen.append(delta)
            if len(seen) == 3:
                break
        assert stream.result is not None
        return stream.result.finish_reason  # type: ignore[attr-defined]

    got = together([cancelled] + [lambda w=w: ask(batched, *w) for w in work[1:]])
    assert got[0] == "cancelled"
    assert got[1:] == want


def test_a_bad_request_fails_alone(tokenizer: Any) -> None:
    batched, serial = engines("llama", tokenizer)
    work = prompts(4)
    want = [ask(serial, *w) for w in work]
    too_long = "x " * (batched.context_window + 10)
    calls = [lambda w=w: ask(batched, *w) for w in work]
    calls.insert(2, lambda: batched.generate(too_long, max_new_tokens=5))
    calls.insert(4, lambda: batched.generate("hi", response_format={"type": "xml"}))
    got = together(calls)
    assert isinstance(got[2], ValueError) and isinstance(got[4], ValueError)
    assert [g for i, g in enumerate(got) if i not in (2, 4)] == want


def test_a_step_that_fails_fails_only_its_request(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token choice that raises mid-decode (a processor, here injected) ends its own
    request only; the others in the batch answer as if alone."""
    batched, serial = engines("llama", tokenizer)
    work = prompts(3)
    want = [ask(serial, *w) for w in work]
    bad = batched.tokenize(work[1][0], passages=work[1][1])
    scores = sampler_module.Sampler._scores

    def boom(self: Any, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        if tokens[: len(bad)] == bad and len(tokens) == len(bad) + 2:
            raise RuntimeError("boom")
        return scores(self, tokens, logits)

    monkeypatch.setattr(sampler_module.Sampler, "_scores", boom)
    got = together([lambda w=w: ask(batched, *w) for w in work])
    assert isinstance(got[1], RuntimeError)
    assert got[0] == want[0] and got[2] == want[2]


def test_max_batch_size_bounds_the_batch(tokenizer: Any) -> None:
    batched, serial = engines("llama", tokenizer, max_batch_size=2)
    work = prompts(5)
    want = [ask(serial, *w) for w in work]
    assert together([lambda w=w: ask(batched, *w) for w in work]) == want
    stats = batched.stats().batch
    assert stats is not None and stats.peak == 2


def test_one_at_a_time_never_batches(tokenizer: Any) -> None:
    _, serial = engines("llama", tokenizer)
    together([lambda w=w: ask(serial, *w) for w in prompts(4)])
    stats = serial.stats().batch
    assert stats is not None and stats.peak == 1 and stats.steps == stats.rows


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_max_batch_size_is_validated(value: Any) -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        KVBoostConfig(max_batch_size=value)


def test_the_batch_thread_ends_when_idle(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_module, "IDLE_SECONDS", 0.2)
    batched, _ = engines("llama", tokenizer)
    together([lambda w=w: ask(batched, *w) for w in prompts(3)])
    deadline = time.monotonic() + 10
    while any(t.name == "kvboost-executor" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the batch thread outlived its work"
        time.sleep(0.05)
    assert ask(batched, *prompts(1)[0])  # and a later request starts a new one


def test_langchain_batch_and_abatch_decode_together(tokenizer: Any) -> None:
    from langchain_core.messages import HumanMessage

    from kvboost_rag.integrations.langchain import ChatKVBoost, KVBoostPipeline

    batched, serial = engines("llama", tokenizer)
    questions = [q for q, _, _ in prompts(8)]
    chat = ChatKVBoost(engine=batched, max_tokens=12)
    want = [
        serial.chat([{"role": "user", "content": q}], max_new_tokens=12).text for q in questions
    ]
    got = chat.batch([[HumanMessage(q)] for q in questions])
    assert [m.content for m in got] == want
    assert batched.stats().batch.peak > 1  # type: ignore[union-attr]

    async def abatch() -> list[Any]:
        return await chat.abatch([[HumanMessage(q)] for q in questions])

    assert [m.content for m in asyncio.run(abatch())] == want
    llm = KVBoostPipeline(engine=batched, max_tokens=12)
    want_llm = [serial.generate(q, max_new_tokens=12).text for q in questions]
    before = batched.stats().batch.steps  # type: ignore[union-attr]
    assert llm.batch(questions) == want_llm
    steps = batched.stats().batch.steps - before  # type: ignore[union-attr]
    assert steps < 12 * len(questions) / 2, "the LLM's batch decoded one prompt at a time"


def test_llamaindex_async_calls_decode_together(tokenizer: Any) -> None:
    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    batched, serial = engines("llama", tokenizer)
    questions = [q for q, _, _ in prompts(8)]
    llm = KVBoostLLM(engine=batched, max_tokens=12)
    want = [serial.generate(q, max_new_tokens=12).text for q in questions]

    async def run() -> list[str]:
        done = await asyncio.gather(*(llm.acomplete(q) for q in questions))
        return [r.text for r in done]

    assert asyncio.run(run()) == want
    assert batched.stats().batch.peak > 1  # type: ignore[union-attr]


def test_stats_do_not_wait_for_the_model(tokenizer: Any) -> None:
    """A monitoring thread reads stats while the model is busy (here: a job holding the
    executor's thread)."""
    batched, _ = engines("llama", tokenizer)
    ask(batched, *prompts(1)[0])
    release = threading.Event()
    job = batched._handle.executor.post(release.wait)
    try:
        got = together([batched.stats], timeout=10)
    finally:
        release.set()
        job.wait()
    assert got[0].requests == 1


def test_a_batch_that_cannot_be_built_fails_its_requests(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that cannot be allocated (say, out of memory) end the requests with the error
    instead of leaving them waiting, and the next requests are served."""
    batched, serial = engines("llama", tokenizer)

    def fail(self: Any, keys: Any, values: Any) -> None:
        raise MemoryError("no room for the batch")

    monkeypatch.setattr(slots_module.SlotLayer, "ensure", fail)
    got = together([lambda w=w: ask(batched, *w) for w in prompts(3)], timeout=60)
    assert all(isinstance(g, MemoryError) for g in got)
    monkeypatch.undo()
    work = prompts(2)
    assert together([lambda w=w: ask(batched, *w) for w in work]) == [ask(serial, *w) for w in work]


def test_a_turn_that_fails_fails_its_batch_and_the_loop_goes_on(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure no request owns (here, a decode step raising while several rows run) ends
    every request in the batch with it, none left waiting, and the next ones are served.
    Ending them once moved rows' KV outside inference mode, which raised on the loop's
    thread: it died and every caller waited forever."""
    batched, serial = engines("llama", tokenizer)
    decode = batch_module.Batch._decode
    failed: list[int] = []

    def failing(self: Any) -> None:
        if self.running() >= 2 and not failed:
            failed.append(self.running())
            raise RuntimeError("the turn failed")
        decode(self)

    monkeypatch.setattr(batch_module.Batch, "_decode", failing)
    got = together([lambda w=w: ask(batched, *w) for w in prompts(3)], timeout=60)
    assert failed, "no decode step ran with two rows"
    ended = [g for g in got if isinstance(g, RuntimeError)]
    assert len(ended) >= failed[0] and all(str(g) == "the turn failed" for g in ended)
    monkeypatch.undo()
    work = prompts(2)
    assert together([lambda w=w: ask(batched, *w) for w in work]) == [ask(serial, *w) for w in work]
