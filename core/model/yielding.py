"""Forwards that give way to requests: background work is dropped between two decoder
layers when a request arrives, and run again later.

The executor runs work nobody waits for (passages a cold prompt deferred, the first-use
forwards of a new engine) only while no request is waiting or running, but a forward, once
started, used to run to its end: on Qwen2.5-Coder-1.5B (bf16, 2-core AMD EPYC) the next
request's first token came 10.5 s after it was sent instead of 2.5 s, behind encodes of
the previous prompt's passages. Inside ``preemptible`` every decoder layer first asks
``should_yield``; when it says so, ``Preempted`` is raised there, so a request waits for
one layer at most. What the dropped forward computed is lost: its work must be safe to
run again from its start (caches of its own, nothing stored before its forwards end).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any


class Preempted(Exception):
    """Raised inside a preemptible forward when a request arrived: run the work again."""


@contextmanager
def preemptible(layers: Sequence[Any], should_yield: Callable[[], bool]) -> Iterator[None]:
    """Inside, forwards on this thread through ``layers`` (the decoder layers) raise
    ``Preempted`` before a layer when ``should_yield()`` is true. Other threads' forwards
    on the same model (a user's own ``generate``) are untouched; the hooks go on exit."""
    me = threading.get_ident()

    def check(module: Any, args: Any) -> None:
        if threading.get_ident() == me and should_yield():
            raise Preempted

    hooks = [layer.register_forward_pre_hook(check) for layer in layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
