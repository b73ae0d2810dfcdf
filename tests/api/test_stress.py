"""Stress: threads mixing generate / stream / early cancel / warm / warm_corpus / clear_cache
/ stats, alongside asyncio tasks calling the LangChain chat model (``ainvoke``,
``astream``) and the LlamaIndex LLM (``acomplete``, ``astream_complete``, an early
``aclose``), on one engine and on two engines sharing one model, under a memory budget
that evicts all the time, at fidelity "exact" and "balanced".

Properties: every answer is one the serial run gives (greedy, fp32). At "exact" that is
the full prefill's whatever the caches hold; at "balanced" a prompt's one passage is
either cached (reused and repaired) or not (prefilled plainly), so the serial run records
both answers and each concurrent answer must be one of them. Nothing deadlocks (the whole
mix has a deadline; the stuck threads' stacks are printed), the memory budget holds at
every stats call, the request count adds up, and no thread is left behind.

The always-on sample is 4 threads x 12 operations plus 12 async tasks per case; the
``slow`` variant (``pytest -m slow``) runs STRESS_OPS operations per thread (default 100)."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import pytest
from conftest import make_model, make_tokenizer

from kvboost_rag import KVBoost, KVBoostConfig, format_passages, warm_corpus
from kvboost_rag.warm import chat_prefix

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402

from kvboost_rag.integrations.langchain import ChatKVBoost  # noqa: E402
from kvboost_rag.integrations.llamaindex import KVBoostLLM  # noqa: E402

HEAD = "System: answer in one word. Context: the river is long and the hill is steep.\n"
DOCS = [f"Note {i}: the key {i} opens door {i * 5 % 11} of the hall." for i in range(6)]
# One passage per prompt, each prompt its own: at "balanced" a prompt is then either a hit
# or a miss, never a mix of the two.
QUESTIONS = [f"Question {i}: which door does key {i} open?" for i in range(6)]
PROMPTS = [HEAD + format_passages([d]) + q for d, q in zip(DOCS, QUESTIONS)]
CHAT_PREFIX = chat_prefix(HEAD)
BUDGET = 48 * 1024  # small enough that entries are evicted all the time
NEW_TOKENS = 6
THREAD_OPS = ["generate", "stream", "cancel", "warm", "warm_corpus", "clear", "stats"]
ASYNC_OPS = ["ainvoke", "astream", "acomplete", "astream_complete", "aclose"]
ANSWERING = {"generate", "stream", "ainvoke", "astream", "acomplete", "astream_complete"}
THREADS = 4
DEADLINE_S = 300  # the whole mix; a deadlock fails here, not by hanging the suite


def config(fidelity: str) -> KVBoostConfig:
    # "encode": a passage is reused only from its own prompt prefix's variant, so the
    # text and chat layouts never serve each other (that would be a third answer).
    return KVBoostConfig(
        fidelity=fidelity, block_tokens=8, max_cache_bytes=BUDGET, prefix_fallback="encode"
    )


def chat_messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": HEAD},
        {"role": "user", "content": format_passages([DOCS[i]]) + QUESTIONS[i]},
    ]


def langchain_messages(i: int) -> list:
    return [
        SystemMessage(HEAD),
        HumanMessage(format_passages([DOCS[i]]) + QUESTIONS[i]),
    ]


@dataclass(frozen=True)
class Serial:
    """The answers a serial run gives per prompt: token ids and texts, completion and chat."""

    tokens: dict[int, set[tuple[int, ...]]]
    texts: dict[int, set[str]]
    chat_texts: dict[int, set[str]]


def serial_answers(fidelity: str) -> Serial:
    """Each prompt cold (fresh engine) and, at "balanced", with its passage warmed."""
    tokens: dict[int, set[tuple[int, ...]]] = {i: set() for i in range(len(DOCS))}
    texts: dict[int, set[str]] = {i: set() for i in range(len(DOCS))}
    chat_texts: dict[int, set[str]] = {i: set() for i in range(len(DOCS))}
    for warmed in (False, True) if fidelity == "balanced" else (False,):
        roomy = replace(config(fidelity), max_cache_bytes=2**30)  # nothing warmed is evicted
        engine = KVBoost(make_model("llama"), make_tokenizer(), roomy)
        if warmed:
            warm_corpus(engine, DOCS, prefix=HEAD, progress=False)
            warm_corpus(engine, DOCS, prefix=CHAT_PREFIX, progress=False)
        for i, prompt in enumerate(PROMPTS):
            result = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
            chat = engine.chat(chat_messages(i), max_new_tokens=NEW_TOKENS)
            assert (result.passages_hit, chat.passages_hit) == ((1, 1) if warmed else (0, 0))
            tokens[i].add(tuple(result.token_ids))
            texts[i].add(result.text)
            chat_texts[i].add(chat.text)
    return Serial(tokens, texts, chat_texts)


@pytest.fixture(scope="module", params=["exact", "balanced"])
def fidelity(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def serial(fidelity: str) -> Serial:
    return serial_answers(fidelity)


def operate(engine: KVBoost, op: str, i: int, serial: Serial) -> str:
    n = i % len(PROMPTS)
    prompt = PROMPTS[n]
    if op == "generate":
        assert (
            tuple(engine.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids) in serial.tokens[n]
        )
    elif op == "stream":
        stream = engine.stream(prompt, max_new_tokens=NEW_TOKENS)
        text = "".join(stream)
        assert tuple(stream.result.token_ids) in serial.tokens[n]  # type: ignore[attr-defined]
        assert text == stream.result.text  # type: ignore[attr-defined]
    elif op == "cancel":
        for _ in engine.stream(prompt, max_new_tokens=64):
            break  # leaving the loop cancels the generation
    elif op == "warm":
        engine.warm(HEAD)
    elif op == "warm_corpus":
        corpus_op(engine, i)
    elif op == "clear":
        engine.clear_cache()
    else:
        stats = engine.stats()
        assert stats.cache.bytes <= BUDGET, stats.cache
    return op


def corpus_op(engine: KVBoost, i: int) -> None:
    docs = DOCS[i % len(DOCS) :][:3]
    prefix = HEAD if i % 2 else CHAT_PREFIX
    if engine.config.fidelity == "exact":
        # No passage reuse: the warm warns (tests/reuse/test_passage_reuse.py asserts it; a warning
        # caught here would race, as catch_warnings is process-wide) and stores nothing.
        report = warm_corpus(engine, docs, prefix=prefix, progress=False)
        assert (report.documents, report.units) == (len(docs), 0)
        return
    report = warm_corpus(engine, docs, prefix=prefix, progress=False)
    assert (report.documents, report.units) == (len(docs), len(docs))


async def operate_async(engine: KVBoost, op: str, i: int, serial: Serial) -> str:
    n = i % len(PROMPTS)
    chat = ChatKVBoost(engine=engine, max_tokens=NEW_TOKENS)
    llm = KVBoostLLM(engine=engine, max_tokens=NEW_TOKENS)
    if op == "ainvoke":
        message = await chat.ainvoke(langchain_messages(n))
        assert message.content in serial.chat_texts[n]
    elif op == "astream":
        parts = [chunk.content async for chunk in chat.astream(langchain_messages(n))]
        assert "".join(parts) in serial.chat_texts[n]  # type: ignore[arg-type]
    elif op == "acomplete":
        assert (await llm.acomplete(PROMPTS[n])).text in serial.texts[n]
    elif op == "astream_complete":
        chunks = [c async for c in await llm.astream_complete(PROMPTS[n])]
        assert chunks[-1].text in serial.texts[n]
        assert "".join(c.delta or "" for c in chunks) == chunks[-1].text
    else:  # leave a stream after its first chunk: closing it cancels the generation
        stream = await llm.astream_complete(PROMPTS[n])
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]
    return op


def run_mix(fidelity: str, serial: Serial, engines: int, per_thread: int, seed: int) -> None:
    model, tokenizer = make_model("llama"), make_tokenizer()
    pool = [KVBoost(model, tokenizer, config(fidelity)) for _ in range(engines)]
    before = set(threading.enumerate())
    rng = random.Random(seed)
    plan = [
        (rng.randrange(engines), rng.choice(THREAD_OPS), rng.randrange(100))
        for _ in range(THREADS * per_thread)
    ]
    tasks = [
        (rng.randrange(engines), rng.choice(ASYNC_OPS), rng.randrange(100))
        for _ in range(per_thread)
    ]

    async def gather() -> list[str]:
        return await asyncio.gather(*(operate_async(pool[e], op, i, serial) for e, op, i in tasks))

    executor = ThreadPoolExecutor(THREADS + 1)
    stuck: set = set()
    try:
        futures = [executor.submit(asyncio.run, gather())]
        futures += [executor.submit(operate, pool[e], op, i, serial) for e, op, i in plan]
        done, stuck = wait(futures, timeout=DEADLINE_S)
        assert not stuck, f"{len(stuck)} operations still running after {DEADLINE_S} s\n" + stacks()
        results = [f.result() for f in futures]  # raises the first failed operation
    finally:
        # A stuck operation cannot be stopped: leave its thread rather than hang the suite.
        executor.shutdown(wait=not stuck, cancel_futures=True)
    assert sorted(results[0]) == sorted(op for _, op, _ in tasks)
    assert sorted(results[1:]) == sorted(op for _, op, _ in plan)
    check_counts(pool, plan + tasks)
    assert all(e.stats().cache.bytes <= BUDGET for e in pool)
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(threading.enumerate()) - before  # no stream, writer or loop thread left


def check_counts(pool: list[KVBoost], ops: list[tuple[int, str, int]]) -> None:
    """Each engine counted every answered request, and a cancelled one at most once."""
    for e, engine in enumerate(pool):
        mine = [op for owner, op, _ in ops if owner == e]
        answered = sum(op in ANSWERING for op in mine)
        cancelled = sum(op in ("cancel", "aclose") for op in mine)
        assert answered <= engine.stats().requests <= answered + cancelled, (e, mine)


def stacks() -> str:
    frames = sys._current_frames()
    return "\n".join(
        f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
        for t in threading.enumerate()
        if t.ident in frames
    )


@pytest.mark.filterwarnings("ignore:kvboost-rag. nothing warmed")
@pytest.mark.parametrize("engines", [1, 2])
def test_mixed_threads_and_tasks_give_the_serial_answers(
    fidelity: str, serial: Serial, engines: int
) -> None:
    run_mix(fidelity, serial, engines, per_thread=12, seed=engines)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:kvboost-rag. nothing warmed")
@pytest.mark.parametrize("engines", [1, 2])
def test_long_mix_gives_the_serial_answers(fidelity: str, serial: Serial, engines: int) -> None:
    per_thread = int(os.environ.get("STRESS_OPS", "100"))
    run_mix(fidelity, serial, engines, per_thread=per_thread, seed=100 + engines)
