"""Stress: threads mixing generate / stream / early cancel / warm / clear_cache / stats on
one engine, and on two engines sharing one model. Every answer equals the serial run's
(fidelity "exact": an answer is the full prefill's whatever the caches hold), nothing
deadlocks (each operation has a timeout), the memory budget holds at every stats call,
the request count adds up, and no thread is left behind. The always-on sample is 4
threads x 12 operations; STRESS_OPS=N sets the operations per thread."""

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import make_model, make_tokenizer

from kvboost_rag import KVBoost, KVBoostConfig

HEAD = "System: answer in one word. Context: the river is long and the hill is steep.\n"
PROMPTS = [f"{HEAD}Question {i}: what is item {i * 7 % 13}?" for i in range(6)]
BUDGET = 48 * 1024  # small enough that entries are evicted all the time
OPS = ["generate", "stream", "cancel", "warm", "clear", "stats"]
PER_THREAD = int(os.environ.get("STRESS_OPS", "12"))
THREADS = 4


def config() -> KVBoostConfig:
    return KVBoostConfig(fidelity="exact", block_tokens=8, max_cache_bytes=BUDGET)


@pytest.fixture(scope="module")
def serial() -> list[list[int]]:
    engine = KVBoost(make_model("llama"), make_tokenizer(), config())
    return [engine.generate(p, max_new_tokens=6).token_ids for p in PROMPTS]


def operate(engine: KVBoost, op: str, i: int, serial: list[list[int]]) -> str:
    prompt = PROMPTS[i % len(PROMPTS)]
    if op == "generate":
        assert engine.generate(prompt, max_new_tokens=6).token_ids == serial[i % len(PROMPTS)]
    elif op == "stream":
        stream = engine.stream(prompt, max_new_tokens=6)
        text = "".join(stream)
        assert stream.result.token_ids == serial[i % len(PROMPTS)]  # type: ignore[attr-defined]
        assert text == stream.result.text  # type: ignore[attr-defined]
    elif op == "cancel":
        for _ in engine.stream(prompt, max_new_tokens=64):
            break  # leaving the loop cancels the generation
    elif op == "warm":
        engine.warm(HEAD)
    elif op == "clear":
        engine.clear_cache()
    else:
        stats = engine.stats()
        assert stats.cache.bytes <= BUDGET, stats.cache
    return op


@pytest.mark.parametrize("engines", [1, 2])
def test_mixed_threads_give_the_serial_answers(serial: list[list[int]], engines: int) -> None:
    model, tokenizer = make_model("llama"), make_tokenizer()
    pool = [KVBoost(model, tokenizer, config()) for _ in range(engines)]
    before = set(threading.enumerate())
    rng = random.Random(engines)
    plan = [
        (pool[rng.randrange(engines)], rng.choice(OPS), rng.randrange(100))
        for _ in range(THREADS * PER_THREAD)
    ]
    with ThreadPoolExecutor(THREADS) as executor:
        futures = [executor.submit(operate, e, op, i, serial) for e, op, i in plan]
        done = [f.result(timeout=120) for f in futures]  # a deadlock fails here
    assert sorted(done) == sorted(op for _, op, _ in plan)
    requests = sum(e.stats().requests for e in pool)
    answered = sum(op in ("generate", "stream") for _, op, _ in plan)
    cancelled = sum(op == "cancel" for _, op, _ in plan)
    assert answered <= requests <= answered + cancelled
    assert all(e.stats().cache.bytes <= BUDGET for e in pool)
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(threading.enumerate()) - before  # no stream or writer thread left
