"""Where the model runs: a waiting caller's forwards on its own thread (a new thread's OpenMP
pool is throttled on a CPU), a stream's on the executor's, and callers arriving while one
runs the loop join its batch."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from batching_setup import ask, engines, prompts, together


def forward_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads every engine's forwards run on from now, as they run."""
    from kvboost_rag.core.generation.runner import Runner

    names: list[str] = []
    original = Runner.run_rows

    def recording(self: Runner, *args: Any, **kwargs: Any) -> Any:
        names.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "run_rows", recording)
    return names


def test_a_waiting_caller_runs_the_model_on_its_own_thread(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking call's forwards run on the caller's thread (where ``generate`` would run
    them: a new thread's OpenMP pool is throttled on a CPU); a stream's on the executor's."""
    batched, serial = engines("llama", tokenizer)
    want = ask(serial, *prompts(1)[0])
    names = forward_threads(monkeypatch)
    assert ask(batched, *prompts(1)[0]) == want
    assert names and set(names) == {threading.current_thread().name}
    names.clear()
    question, passages, n = prompts(1)[0]
    streamed = "".join(batched.stream(question, passages=passages, max_new_tokens=n))
    assert streamed == batched.tokenizer.decode(want, skip_special_tokens=True)
    assert names and set(names) == {"kvboost-executor"}


def test_requests_join_a_callers_loop(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests arriving while a caller runs the loop decode in its batch, and give the
    serial answers whichever caller's request ends first (the rest finish on the
    background thread)."""
    batched, serial = engines("llama", tokenizer)
    work = prompts(4)  # answers of 6, 9, 12 and 15 tokens
    want = [ask(serial, *w) for w in work]
    names = forward_threads(monkeypatch)
    assert together([lambda w=w: ask(batched, *w) for w in work]) == want
    assert batched.stats().batch.peak > 1  # callers joined one loop
    assert names and "MainThread" not in names  # each forward ran on a caller or the executor
