"""A background writer: applies queued items in order on a daemon thread started on
demand, so a tier's writes (disk files, Redis values) overlap compute and stay off the
request path. ``BatchWriter`` applies what is queued in batches (one pipelined round trip
for a batch of shared-tier writes).

The thread ends after ``IDLE_SECONDS`` without work, dropping its reference to the store
that owns it, so an unused store is freed. Stores drain their writer at interpreter exit
(``close``): a daemon thread still inside torch/safetensors code while the interpreter
finalizes aborts the process ("FATAL: exception not rethrown"). After each batch it frees
the OpenMP pool its torch work started (``openmp.py``): kept, it would slow every
decoding step of the serving loop for as long as the thread lives.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from kvboost_rag.core.model import openmp

T = TypeVar("T")
log = logging.getLogger("kvboost_rag")
IDLE_SECONDS = 5.0
_STOP = object()  # queued to end the thread
_halted = threading.Event()


def halt() -> None:
    """The process is ending at once (Ctrl-C in the CLI): from now on no writer applies
    anything more, queued or not. A write under way finishes (each lands whole); the
    queued ones are dropped, as the process exit would drop them a moment later."""
    _halted.set()


def halted() -> bool:
    """Whether ``halt`` was called: every tier write checks it, on any thread."""
    return _halted.is_set()


class Writer(Generic[T]):
    """Thread-safe. ``apply`` should handle its own errors (it runs on the writer thread);
    one it lets through is logged and the thread goes on, so ``join`` never waits forever."""

    def __init__(self, name: str, apply: Callable[[T], None]) -> None:
        self._name = name
        self._apply = apply
        self._queue: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, item: T) -> bool:
        """Queue ``item``; False once closed (the caller then writes it itself)."""
        with self._lock:
            if self._closed:
                return False
            self._queue.put(item)  # under the lock: see _run
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            return True

    def join(self) -> None:
        """Wait until every queued item was applied."""
        self._queue.join()

    def close(self) -> None:
        """Apply what is queued, then end the thread; later ``submit`` calls return False."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(_STOP)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:  # submit and close queue under this lock: none is missed
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            items = [first, *self._more()] if first is not _STOP else [first]
            work = [item for item in items if item is not _STOP]
            try:
                if work:
                    self._apply_all(work)  # type: ignore[arg-type]
            except Exception:
                log.exception("kvboost-rag: %s failed on a queued write", self._name)
            finally:
                openmp.release_pool()
                for _ in items:
                    self._queue.task_done()
            if len(work) < len(items):  # close() queues _STOP after everything else
                return

    def _more(self) -> list[object]:
        """Items queued behind the one just taken that are applied with it: none here."""
        return []

    def _apply_all(self, items: list[T]) -> None:
        for item in items:
            if _halted.is_set():
                return
            try:
                self._apply(item)
            except Exception:
                log.exception("kvboost-rag: %s failed on a queued write", self._name)


class BatchWriter(Writer[T]):
    """A ``Writer`` that hands ``apply_batch`` everything queued when it wakes, up to
    ``max_items`` at once: a batch of shared-tier writes is one pipelined round trip."""

    def __init__(self, name: str, apply_batch: Callable[[list[T]], None], max_items: int) -> None:
        super().__init__(name, lambda item: apply_batch([item]))
        self._apply_batch = apply_batch
        self._max_items = max_items

    def _more(self) -> list[object]:
        more: list[object] = []
        while len(more) < self._max_items - 1:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            more.append(item)
            if item is _STOP:
                break
        return more

    def _apply_all(self, items: list[T]) -> None:
        if not _halted.is_set():
            self._apply_batch(items)
