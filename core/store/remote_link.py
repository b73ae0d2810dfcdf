"""Calls to the shared tier under its fault rules: batches of commands sent as one
pipeline, failures turned into misses, back-offs and warnings, never into exceptions.

A server (or a cluster node) that is down, slow or unreachable, and a cluster that has no
master for a slot yet or holds a slot mid-migration (CLUSTERDOWN, TRYAGAIN), make the tier
unavailable: every call is skipped for a back-off (``Backoff``), one warning per outage. An
error the server answers (out of memory, a read-only replica) is warned about once per
kind; for writes it also pauses them for a back-off of their own. The client is opened on
first use (a cluster client connects then), so a tier that is down at start is one more
failure, not an error.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvboost_rag.core.store.backoff import Backoff
from kvboost_rag.core.store.redis_client import RoundTrips, import_redis, open_client, redact

T = TypeVar("T")
Queue = Callable[[Any], object]  # adds commands to a pipeline


class RemoteLink:
    """Thread-safe."""

    def __init__(self, url: str, timeout: float) -> None:
        errors = import_redis().exceptions
        self._response_error = errors.ResponseError
        # Answers meaning "not now" rather than "no": a slot with no master yet, a slot
        # mid-migration, a redirection the client gave up following.
        self._unavailable = (errors.ClusterDownError, errors.TryAgainError, errors.AskError)
        self.url = redact(url)
        self.round_trips = RoundTrips()
        self._url, self._timeout = url, timeout
        self._client: Any = None
        self._connecting = threading.Lock()
        self._health = Backoff(self.url)
        # After the server refuses a write (out of memory, read-only): no writes for a while,
        # rather than sending every multi-MB value only to have it refused.
        self._refusals = Backoff(self.url, warn=False)
        self._reads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvboost-redis-read")
        self._lock = threading.Lock()
        self._answered: set[str] = set()  # kinds of server errors already warned about
        self.errors = 0  # calls that failed (a batch: once per kind of error)

    def available(self) -> bool:
        return self._health.available()

    def writable(self) -> bool:
        """Available, and no write was refused for the refusals' back-off."""
        return self._health.available() and self._refusals.available()

    def pipeline(
        self, queue: Queue, size: int, bounded: bool = False, write: bool = False
    ) -> list[Any]:
        """The answers of the ``size`` commands ``queue`` adds to one pipeline, in order;
        None for each command that failed, and for all while backing off or when the
        whole batch failed. ``bounded``: the batch, its values' transfer included, gets
        ``timeout`` in all (a read on the request path), not each socket operation.
        ``write``: an error the server answers pauses writes."""
        answers = self.call(lambda client: _execute(client, queue), None, bounded, write)
        if answers is None:
            return [None] * size
        assert len(answers) == size, (len(answers), size)
        failures = {type(a): a for a in answers if isinstance(a, Exception)}
        for error in failures.values():
            self._failed(error, write)
        if not any(self._down(error) for error in failures.values()):
            self._health.succeeded()
            if write and not failures:
                self._refusals.succeeded()
        return [None if isinstance(a, Exception) else a for a in answers]

    def call(
        self, op: Callable[[Any], T], fallback: T, bounded: bool = False, write: bool = False
    ) -> T:
        """``op(client)``, or ``fallback`` while backing off or when it fails (reported).
        A success is not reported here: ``pipeline`` checks the answers first."""
        if not self._health.available():
            return fallback
        try:
            return self._bounded(op) if bounded else op(self._connected())
        except Exception as error:  # connection, timeout, protocol: reported, then skipped
            self._failed(error, write)
            return fallback

    def warn_once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._answered:
                return
            self._answered.add(kind)
        warnings.warn(
            f"kvboost-rag: the shared KV tier at {self.url} answered an error ({message}); "
            "such operations are skipped, the KV stays in the local tiers",
            stacklevel=6,
        )

    def _down(self, error: Exception) -> bool:
        """Whether ``error`` says the tier cannot serve now (else the server refused)."""
        answered = isinstance(error, self._response_error)
        return not answered or isinstance(error, self._unavailable)

    def _failed(self, error: Exception, write: bool) -> None:
        with self._lock:
            self.errors += 1
        if self._down(error):  # do not trust the server (or the cluster) for a while
            self._health.failed(error)
            return
        self.warn_once(type(error).__name__, f"{type(error).__name__}: {error}")
        if write:  # the server answered: it is up, but refuses writes
            self._refusals.failed(error)

    def _connected(self) -> Any:
        with self._connecting:
            if self._client is None:
                self._client = open_client(self._url, self._timeout, self.round_trips)
            return self._client

    def _bounded(self, op: Callable[[Any], T]) -> T:
        """``op(client)`` on a reader thread, waited for at most ``timeout``: a value that
        trickles in over a slow link is abandoned (its read ends in the background) and
        counts as a failure, like a server that does not answer."""
        future = self._reads.submit(lambda: op(self._connected()))
        try:
            return future.result(timeout=self._timeout)
        except FutureTimeout:
            raise TimeoutError(f"a read took over {self._timeout} s") from None


def _execute(client: Any, queue: Queue) -> list[Any]:
    """One pipeline of what ``queue`` adds, without MULTI (on a cluster its keys live on
    several nodes): each command's answer, or the error it got."""
    pipe = client.pipeline(transaction=False)
    queue(pipe)
    return list(pipe.execute(raise_on_error=False))
