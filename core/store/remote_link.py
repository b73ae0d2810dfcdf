"""Calls to the shared tier under its fault rules: a batch of commands sent as one
pipeline per node, failures turned into misses, back-offs and warnings, never into
exceptions.

Health is kept per node (one server is one node; a cluster's nodes are found from its
slot layout, no I/O): a node that is down, slow or unreachable, or a cluster answering
that a slot has no master yet or is mid-migration (CLUSTERDOWN, TRYAGAIN), is skipped for
a back-off (``Backoff``), one warning per outage, while the other nodes' keys are still
read and written. A success on one node never ends another's outage, so a cluster with a
master down neither warns again nor retries that master sooner than its back-off says. An
error a node answers (out of memory, a read-only replica) is warned about once per kind;
for writes it also pauses that node's writes for a back-off of their own. The client is
opened on first use (a cluster client connects then): a tier down at start is one more
outage, not an error.

A read's batch (``bounded``) gets ``timeout`` in all, every node's pipeline running at
once on a reader thread: a value trickling in over a slow link is abandoned, not waited
for, and its node counts as failed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvboost_rag.core.caller_warnings import warn
from kvboost_rag.core.remote_url import is_cluster, redact
from kvboost_rag.core.store.backoff import Backoff
from kvboost_rag.core.store.redis_client import RoundTrips, import_redis, open_client

T = TypeVar("T")
log = logging.getLogger("kvboost_rag")
TIER = ""  # the node name of a single server, and of the cluster client's own setup


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
        self._url, self._timeout, self._cluster = url, timeout, is_cluster(url)
        self._client: Any = None
        self._connecting = threading.Lock()
        self._lock = threading.Lock()
        self._health: dict[str, Backoff] = {}
        # After a node refuses a write (out of memory, read-only): no writes to it for a
        # while, rather than sending every multi-MB value only to have it refused.
        self._refusals: dict[str, Backoff] = {}
        self._reads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvboost-redis-read")
        self._answered: set[str] = set()  # kinds of server errors already warned about
        self._outage = False  # some node is down: warned about, not yet all back
        self.errors = 0  # node batches that failed (once per kind of error each)

    def available(self) -> bool:
        """False from a failure of any node (or of the tier itself) until it answers
        again. Not whether a retry is due: that changes with the clock, mid-outage."""
        return not any(b.down for b in self._serving())

    def pipeline(
        self,
        command: str,
        names: Sequence[bytes],
        values: Sequence[bytes] | None = None,
        bounded: bool = False,
        write: bool = False,
    ) -> list[Any]:
        """Per name, the answer to ``command name [value]``: None where its node is
        backing off, its batch or its command failed. One pipeline per node. ``bounded``:
        a read on the request path (see the module). ``write``: nodes refusing writes are
        skipped, and an error a node answers pauses its writes."""
        answers: list[Any] = [None] * len(names)
        groups = self._groups(names, write, bounded)
        runs = {node: self._run(command, names, values, at, bounded) for node, at in groups.items()}
        deadline = time.monotonic() + self._timeout
        for node, run in runs.items():
            found = self._result(node, run, deadline if bounded else None, write)
            for i, answer in zip(groups[node], found):
                answers[i] = answer
        return answers

    def call(self, op: Callable[[Any], T], fallback: T) -> T:
        """``op(client)`` on the tier as a whole (a setting, say), or ``fallback`` while
        it backs off or when it fails (reported)."""
        if not self._backoff(TIER).available():
            return fallback
        try:
            result = op(self._connected())
        except Exception as error:  # connection, timeout, protocol: reported, then skipped
            self._failed(TIER, error, False)
            return fallback
        self._succeeded(TIER)
        return result

    def warn_once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._answered:
                return
            self._answered.add(kind)
        warn(
            f"kvboost-rag: the shared KV tier at {self.url} answered an error ({message}); "
            "such operations are skipped, the KV stays in the local tiers"
        )

    def _groups(self, names: Sequence[bytes], write: bool, bounded: bool) -> dict[str, list[int]]:
        """Indices of ``names`` per node that may be asked now."""
        if not names or not self._backoff(TIER).available():
            return {}
        try:
            nodes = self._nodes(names, bounded)
        except Exception as error:  # the cluster client could not connect: the tier is down
            self._failed(TIER, error, write)
            return {}
        if self._cluster:  # connected: the cluster as a whole is reachable again
            self._succeeded(TIER)
        groups: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            groups.setdefault(node, []).append(i)
        return {node: at for node, at in groups.items() if self._open(node, write)}

    def _nodes(self, names: Sequence[bytes], bounded: bool) -> list[str]:
        """The node serving each name, from the client's slot layout (no I/O once open;
        opening it, a read waits ``timeout`` at most, as for its batch)."""
        if not self._cluster:
            return [TIER] * len(names)
        if self._client is None and bounded:
            try:
                self._reads.submit(self._connected).result(timeout=self._timeout)
            except FutureTimeout:
                raise TimeoutError(f"connecting took over {self._timeout} s") from None
        client = self._connected()
        return [client.get_node_from_key(name).name for name in names]

    def _open(self, node: str, write: bool) -> bool:
        if not self._backoff(node).available():
            return False
        return not write or self._backoff(node, self._refusals).available()

    def _run(
        self,
        command: str,
        names: Sequence[bytes],
        values: Sequence[bytes] | None,
        at: list[int],
        bounded: bool,
    ) -> Future[list[Any]]:
        """One node's pipeline: on a reader thread for a bounded read (the nodes' batches
        run at once), else here (a future already done)."""
        args: list[tuple[bytes, ...]] = [
            (names[i],) if values is None else (names[i], values[i]) for i in at
        ]
        work = lambda: _execute(self._connected(), command, args)  # noqa: E731
        if bounded:
            return self._reads.submit(work)
        done: Future[list[Any]] = Future()
        try:
            done.set_result(work())
        except Exception as error:  # noqa: BLE001 -- reported by _result
            done.set_exception(error)
        return done

    def _result(
        self, node: str, run: Future[list[Any]], deadline: float | None, write: bool
    ) -> list[Any]:
        """A node's answers with failed commands as None; each failure reported once."""
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            answers = run.result(timeout=wait)
        except FutureTimeout:
            answers = [TimeoutError(f"a read took over {self._timeout} s")]
        except Exception as batch_error:  # connection, timeout, protocol: the whole batch
            answers = [batch_error]
        failures = {type(a): a for a in answers if isinstance(a, Exception)}
        for failure in failures.values():
            self._failed(node, failure, write)
        if not any(self._down(failure) for failure in failures.values()):
            self._succeeded(node)
            if write and not failures:
                self._backoff(node, self._refusals).succeeded()
        return [None if isinstance(a, Exception) else a for a in answers]

    def _down(self, error: Exception) -> bool:
        """Whether ``error`` says the node cannot serve now (else it refused)."""
        answered = isinstance(error, self._response_error)
        return not answered or isinstance(error, self._unavailable)

    def _failed(self, node: str, error: Exception, write: bool) -> None:
        with self._lock:
            self.errors += 1
        if self._down(error):  # do not trust the node for a while
            self._backoff(node).failed()
            self._warn_outage(node, error)
            return
        self.warn_once(type(error).__name__, f"{type(error).__name__}: {error}")
        if write:  # the node answered: it is up, but refuses writes
            self._backoff(node, self._refusals).failed()

    def _warn_outage(self, node: str, error: Exception) -> None:
        """One warning when the tier's first node fails, none while any is still down."""
        with self._lock:
            if self._outage:
                return
            self._outage = True
        if not _OUTAGES.began(self._url, self):
            return  # another engine's link to this tier warned of this fault
        where = self.url if node == TIER else f"{self.url} (node {node})"
        warn(
            f"kvboost-rag: the shared KV tier at {where} is unavailable ({error}); "
            "serving from local tiers, retrying in the background"
        )

    def _succeeded(self, node: str) -> None:
        self._backoff(node).succeeded()
        with self._lock:
            if not self._outage:
                return
        if any(b.down for b in self._serving()):
            return
        with self._lock:
            if not self._outage:  # another thread saw it end first
                return
            self._outage = False
        if _OUTAGES.ended(self._url, self):
            log.warning("kvboost-rag: the shared KV tier at %s is back", self.url)

    def _serving(self) -> list[Backoff]:
        """The back-offs of the nodes that serve the tier now: on a cluster, of its
        masters (a master a failover replaced no longer counts, down as it may be)."""
        masters: set[str] | None = None
        if self._cluster and self._client is not None:
            masters = {node.name for node in self._client.get_primaries()} | {TIER}
        with self._lock:
            return [b for n, b in self._health.items() if masters is None or n in masters]

    def _backoff(self, node: str, table: dict[str, Backoff] | None = None) -> Backoff:
        table = self._health if table is None else table
        with self._lock:
            return table.setdefault(node, Backoff())

    def _connected(self) -> Any:
        with self._connecting:
            if self._client is None:
                self._client = open_client(self._url, self._timeout, self.round_trips)
            return self._client


class _Outages:
    """The links in an outage, per tier URL, over every engine of the process: engines on
    one server (storage.md's two "machines" in one script) see one fault, one warning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[str, weakref.WeakSet[RemoteLink]] = {}

    def began(self, url: str, link: RemoteLink) -> bool:
        """Whether ``link``'s outage is the tier's first (no live link of it is down)."""
        with self._lock:
            down = self._down.setdefault(url, weakref.WeakSet())
            first = not down
            down.add(link)
        return first

    def ended(self, url: str, link: RemoteLink) -> bool:
        """Whether ``link`` was the last of the tier's links in an outage."""
        with self._lock:
            down = self._down.get(url, weakref.WeakSet())
            down.discard(link)
            return not down


# Process-wide as the server is: the per-link state cannot know another engine warned.
_OUTAGES = _Outages()


def _execute(client: Any, command: str, args: list[tuple[bytes, ...]]) -> list[Any]:
    """One pipeline of ``command`` over ``args``, without MULTI (a cluster pipeline routes
    each key by its slot): each command's answer, or the error it got."""
    pipe = client.pipeline(transaction=False)
    for arg in args:
        getattr(pipe, command)(*arg)
    return list(pipe.execute(raise_on_error=False))
