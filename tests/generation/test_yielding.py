"""Work nobody waits for (passages a cold prompt deferred) gives way to requests: a request
arriving while it runs is served first, and the work still ends once the engine is idle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import found, make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.prompt.chunker import passage
from kvboost_rag.core.reuse.passage_encoder import PassageEncoder

DOCS = [
    "The lighthouse keeper logs the weather at dawn and dusk.",
    "Copper conducts heat far better than stainless steel does.",
    "A sourdough starter needs flour, water and a warm kitchen.",
]
COLD = "".join(passage(d) for d in DOCS) + "Question: what melts? Answer:"
OTHER = "Question: name three metals. Answer:"


def balanced(tokenizer: Any) -> KVBoost:
    return KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8))


class Encodes:
    """Records, on the executor's thread, each passage encode that ends and each request
    forward; ``hold`` makes the first encode wait inside its forward (at the first decoder
    layer) until ``release``; ``layer_seconds`` makes every encode's layer that slow."""

    def __init__(self, engine: KVBoost, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tokenizer = engine.tokenizer
        self.events: list[Any] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.hold = False
        self.layer_seconds = 0.0
        self._inside = threading.local()
        encode, run_rows = PassageEncoder.encode_batch, Runner.run_rows

        def encoding(encoder: Any, prefix: Any, passages: Any) -> Any:
            self._inside.on = True
            try:
                kv = encode(encoder, prefix, passages)
            finally:
                self._inside.on = False
            self.events.append(("encoded", tuple(passages[0])))
            return kv

        def running(runner: Any, *args: Any, **kwargs: Any) -> Any:
            self.events.append("forward")
            return run_rows(runner, *args, **kwargs)

        monkeypatch.setattr(PassageEncoder, "encode_batch", encoding)
        monkeypatch.setattr(Runner, "run_rows", running)
        for layer in engine.support.layers:
            layer.register_forward_pre_hook(self._layer)

    def _layer(self, module: Any, args: Any) -> None:
        if not getattr(self._inside, "on", False):
            return
        time.sleep(self.layer_seconds)
        if self.hold and not self.release.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never released the encode"

    def encoded(self) -> list[str]:
        """The passages encoded, in order."""
        return [self.tokenizer.decode(list(e[1])) for e in self.events if e != "forward"]


def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def test_a_request_arriving_during_a_deferred_encode_is_served_first(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = balanced(tokenizer).generate(OTHER, max_new_tokens=6).token_ids  # an idle engine's
    engine = balanced(tokenizer)
    encodes = Encodes(engine, monkeypatch)
    encodes.hold = True
    cold = engine.generate(COLD, max_new_tokens=4)
    assert cold.passages_missed == 3 and cold.reused_tokens == 0  # deferred after the answer
    assert encodes.entered.wait(30), "no deferred encode started"
    encodes.events.clear()
    executor = engine._handle.executor
    thread, out = in_thread(lambda: engine.generate(OTHER, max_new_tokens=6))
    until(lambda: bool(executor._waiting))  # queued behind the encode held in its forward
    before = executor.preempted
    encodes.release.set()
    thread.join(30)
    assert out and out[0].token_ids == want
    assert executor.preempted > before
    assert encodes.events[0] == "forward", encodes.events  # the request's, before any encode
    engine.flush()
    assert sorted(encodes.encoded()) == sorted(DOCS)
    reordered = "".join(passage(d) for d in DOCS[::-1]) + OTHER
    again = engine.generate(reordered, max_new_tokens=4)
    assert (found(again), again.passages_missed) == (3, 0)


def test_deferred_encodes_end_when_the_engine_is_idle_and_flush_waits_for_them(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = balanced(tokenizer)
    encodes = Encodes(engine, monkeypatch)
    encodes.layer_seconds = 0.05  # each encode takes 0.15 s or more
    engine.generate(COLD, max_new_tokens=4)
    assert len(encodes.encoded()) < 3  # not done when the answer is
    engine.flush()
    assert len(encodes.encoded()) == 3
    other = balanced(tokenizer)
    encodes = Encodes(other, monkeypatch)
    encodes.layer_seconds = 0.05
    other.generate(COLD, max_new_tokens=4)
    until(lambda: len(encodes.encoded()) == 3)  # nobody asked: the idle loop ran them


def test_a_lookup_has_the_passages_it_waits_for_encoded_first(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = balanced(tokenizer)
    encodes = Encodes(engine, monkeypatch)
    encodes.hold = True
    engine.generate(COLD, max_new_tokens=4)
    assert encodes.entered.wait(30)
    jobs = engine._caches._jobs
    hurried = [job for tokens, queued in jobs.items() for job in queued if job.urgent]
    assert not hurried
    thread, out = in_thread(lambda: engine.generate(passage(DOCS[2]) + OTHER, max_new_tokens=4))
    until(lambda: any(job.urgent for queued in list(jobs.values()) for job in queued))
    encodes.release.set()
    thread.join(30)
    assert out and found(out[0]) == 1
    engine.flush()
    assert encodes.encoded() == [DOCS[0], DOCS[2], DOCS[1]]


def test_a_lookup_pauses_deferred_work(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next request's lookup (index updates, tier reads) runs while the deferred encode
    is dropped, before the request even queues for the model."""
    from kvboost_rag.core.reuse import caches

    engine = balanced(tokenizer)
    encodes = Encodes(engine, monkeypatch)
    encodes.hold = True
    engine.generate(COLD, max_new_tokens=4)
    assert encodes.entered.wait(30)
    executor = engine._handle.executor
    looking, looked = threading.Event(), threading.Event()
    look_up = caches.look_up

    def slow_look_up(*args: Any, **kwargs: Any) -> Any:
        looking.set()
        assert looked.wait(30)
        return look_up(*args, **kwargs)

    monkeypatch.setattr(caches, "look_up", slow_look_up)
    thread, out = in_thread(lambda: engine.generate(OTHER, max_new_tokens=4))
    assert looking.wait(30)
    before = executor.preempted
    encodes.release.set()
    until(lambda: executor.preempted > before or bool(encodes.encoded()))
    assert not executor._waiting and not encodes.encoded()  # dropped during the lookup
    looked.set()
    thread.join(30)
    assert out and out[0].token_ids
    engine.flush()
    assert sorted(encodes.encoded()) == sorted(DOCS)


def test_a_lookup_waits_only_for_the_index_updates_it_can_use(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an answer leaves in the exact prefix cache is stored by the indexer thread; a
    later prompt sharing none of it does not wait for it, one that continues it does."""
    from kvboost_rag.core.reuse.caches import Caches
    from kvboost_rag.core.reuse.prefix import PrefixCache

    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(fidelity="exact"))
    release, waiting = threading.Event(), threading.Event()
    insert, await_index = PrefixCache.insert, Caches._await_index

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30), "the test never released the index update"
        return insert(*args, **kwargs)

    def awaiting(caches: Any, tokens: Any) -> None:
        if caches._indexing:
            waiting.set()
        await_index(caches, tokens)

    monkeypatch.setattr(PrefixCache, "insert", held)
    monkeypatch.setattr(Caches, "_await_index", awaiting)
    story = "Once upon a time a lighthouse keeper logged the weather."
    engine.generate(story, max_new_tokens=4)  # its index update is held
    other, out = in_thread(lambda: engine.generate(OTHER, max_new_tokens=4))
    other.join(30)
    assert out and not other.is_alive()  # shares no token with it: did not wait
    waiting.clear()
    more, after = in_thread(lambda: engine.generate(story + " And then", max_new_tokens=4))
    assert waiting.wait(30) and more.is_alive()
    release.set()
    more.join(30)
    assert after and after[0].reused_tokens >= len(engine.tokenize(story)) - 8
