"""A background writer: applies queued items in order on a daemon thread started on
demand, so a tier's writes (disk files, Redis values) overlap compute and stay off the
request path.

The thread ends after ``IDLE_SECONDS`` without work, dropping its reference to the store
that owns it, so an unused store is freed. Stores drain their writer at interpreter exit
(``close``): a daemon thread still inside torch/safetensors code while the interpreter
finalizes aborts the process ("FATAL: exception not rethrown").
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("kvboost_rag")
IDLE_SECONDS = 5.0
_STOP = object()  # queued to end the thread


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
                item = self._queue.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:  # submit and close queue under this lock: none is missed
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                if item is _STOP:
                    return
                self._apply(item)  # type: ignore[arg-type]
            except Exception:
                log.exception("kvboost-rag: %s failed on a queued write", self._name)
            finally:
                self._queue.task_done()
