"""What the batching tests share: requests that share no passage, a batching and a serial
engine on two copies of one model, and calls released together."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig

PASSAGES = [
    "The lighthouse keeper logs the weather at dawn and dusk.",
    "Copper conducts heat far better than stainless steel does.",
    "A sourdough starter needs flour, water and a warm kitchen.",
    "The river floods each spring when the mountain snow melts.",
]


def prompts(n: int) -> list[tuple[str, list[str], int]]:
    """n requests: a question, two passages of its own, a length of its own. No passage or
    prefix is shared: with passage reuse, what one request caches (its session KV, a
    passage variant) changes what a later one reads, so shared ones would make answers
    depend on the order requests arrive in, batched or not."""
    return [
        (
            f"Question {i}: what follows from {'xyz' * (i % 4)}? Answer briefly.",
            [f"Note {i}. {PASSAGES[i % 4]}", f"Fact {i}. {PASSAGES[(i + 1 + i // 4) % 4]}"],
            6 + 3 * i,
        )
        for i in range(n)
    ]


def engines(arch: str, tokenizer: Any, **config: Any) -> tuple[KVBoost, KVBoost]:
    """A batching engine and a one-at-a-time engine on two copies of one model."""
    batched = KVBoost(make_model(arch), tokenizer, KVBoostConfig(block_tokens=8, **config))
    serial = KVBoost(
        make_model(arch),
        tokenizer,
        KVBoostConfig(block_tokens=8, **{**config, "max_batch_size": 1}),
    )
    return batched, serial


def together(calls: list[Callable[[], Any]], timeout: float = 120.0) -> list[Any]:
    """Run every call in its own thread, released at once; results (or errors) in order."""
    out: list[Any] = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        try:
            out[i] = calls[i]()
        except Exception as error:  # returned, so a test can check who failed
            out[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a request did not finish: deadlock?"
    return out


def ask(engine: KVBoost, question: str, passages: list[str], n: int, **options: Any) -> list[int]:
    return engine.generate(question, passages=passages, max_new_tokens=n, **options).token_ids
