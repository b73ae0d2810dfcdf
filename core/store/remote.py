"""Shared tier: KV entries in Redis (or Valkey), warmed once for every machine.

Keys are ``<namespace>:<model fingerprint>:<cache key>`` and values are ``codec`` entries
(safetensors, checksummed, never pickle), so a value written by another model, a damaged
or a truncated one is dropped with a warning and recomputed. A SET is atomic: readers see
a whole value or none, and concurrent writers of one key each write a whole valid value.

The server evicts by its own policy (``maxmemory`` + ``allkeys-lru``): a vanished key is a
miss. Writes go through a background ``Writer``, never the request path; a key already
present is not sent again, and a value over the server's ``proto-max-bulk-len`` is skipped.

Faults never reach the caller: a server that is down, slow or restarting makes every call
a miss for a back-off (0.5 s, doubling to 30 s) announced by one warning per outage. A
read on the request path gets ``timeout`` in all (a value trickling in over a slow link
is abandoned, not waited for); background writes get it per socket operation. An error
the server answers (out of memory, read-only replica) is warned about once per kind, and
writes pause for a back-off of their own. Requests go on from the local tiers.
"""

from __future__ import annotations

import atexit
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.store import codec
from kvboost_rag.core.store.backoff import Backoff
from kvboost_rag.core.store.memory import Entry
from kvboost_rag.core.store.writer import Writer

T = TypeVar("T")
DEFAULT_MAX_VALUE = 512 * 1024**2  # Redis's proto-max-bulk-len default
_Write = tuple[bytes, tuple[int, ...], LayerKV, bool]


@dataclass(frozen=True)
class RemoteStats:
    url: str  # the server, password removed
    available: bool  # False while backing off after a failure
    hits: int
    misses: int  # absent, evicted, or skipped while the server was unavailable
    corrupt: int  # values found damaged or foreign, deleted
    writes: int  # values written
    written_bytes: int
    skipped: int  # writes not sent: already present, too large, or server unavailable
    errors: int  # calls that failed (connection, timeout, or an error the server answered)


class RemoteStore:
    """Thread-safe; any number of processes and machines may share one server."""

    def __init__(
        self,
        url: str,
        fingerprint: bytes,
        *,
        namespace: str = "kvboost",
        timeout: float = 0.5,
        kv_codec: str = "none",
        secret: bytes | None = None,
    ) -> None:
        redis = import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = redact(url)
        self.fingerprint = fingerprint.hex()
        self.codec = kv_codec
        self._secret = secret  # signs every value written; values read must carry it
        self._errors = redis.exceptions
        # No client-side retries: the back-off decides when to try again.
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        self._prefix = f"{namespace}:{self.fingerprint}:".encode()
        self._timeout = timeout
        self._health = Backoff(self.url)
        # After the server refuses a write (out of memory, read-only): no writes for a while,
        # rather than sending every multi-MB value only to have it refused.
        self._refusals = Backoff(self.url, warn=False)
        self._reads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvboost-redis-read")
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "writes", "written_bytes", "skipped", "errors"), 0
        )
        self._answered: set[str] = set()  # kinds of server errors already warned about
        self._max_value: int | None = None
        self._pending: set[bytes] = set()
        self._writer: Writer[_Write] = Writer("kvboost-redis-writer", self._write)
        atexit.register(_close_at_exit, weakref.ref(self))

    def name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def get(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        data = self._call(lambda c: c.get(self.name(key)), None, bounded=True)
        if data is None:
            return self._count("misses", None)
        try:
            entry = codec.from_bytes(data, key, self.fingerprint, self._secret)
        except ValueError as error:
            warnings.warn(
                f"kvboost-rag: dropping damaged shared cache value {self.name(key).decode()} "
                f"({error}); its KV will be recomputed",
                stacklevel=4,
            )
            self._count("corrupt", None)
            self._call(lambda c: c.delete(self.name(key)), None)
            return self._count("misses", None)
        if tokens is not None and entry.tokens != tokens:
            return self._count("misses", None)
        return self._count("hits", entry)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._pending:
                return True
        return bool(self._call(lambda c: c.exists(self.name(key)), 0))

    def put_later(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> None:
        """Queue a write-through; ``flush()`` waits for it. Nothing is raised: a write that
        cannot be made is counted and the entry stays in the local tiers."""
        with self._lock:
            self._pending.add(key)
        if not self._writer.submit((key, tokens, kv, approximate)):
            self._write((key, tokens, kv, approximate))

    def flush(self) -> None:
        """Wait until queued writes were sent (or skipped)."""
        self._writer.join()

    def close(self) -> None:
        self._writer.close()

    def stats(self) -> RemoteStats:
        with self._lock:
            return RemoteStats(self.url, self._health.available(), **self._counts)

    def _write(self, item: _Write) -> None:
        key, tokens, kv, approximate = item
        try:
            self._send(key, tokens, kv, approximate)
        finally:
            with self._lock:
                self._pending.discard(key)

    def _send(self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool) -> None:
        name = self.name(key)
        if not (self._health.available() and self._refusals.available()) or self._call(
            lambda c: c.exists(name), 1
        ):
            self._count("skipped", None)  # unavailable, refusing, or another writer was first
            return
        data = codec.to_bytes(
            key, self.fingerprint, tokens, kv, self.codec, approximate, self._secret
        )
        if len(data) > self._value_limit():
            self._once("too-large", f"a {len(data)}-byte value is over the server's limit")
            self._count("skipped", None)
            return
        if self._call(lambda c: c.set(name, data), None, refused=self._refusals.failed):
            self._refusals.succeeded()
            with self._lock:
                self._counts["writes"] += 1
                self._counts["written_bytes"] += len(data)
        else:
            self._count("skipped", None)

    def _value_limit(self) -> int:
        if self._max_value is None:
            found = self._call(lambda c: c.config_get("proto-max-bulk-len"), None) or {}
            limit = found.get("proto-max-bulk-len")
            self._max_value = int(limit) if limit else DEFAULT_MAX_VALUE
        return self._max_value

    def _call(
        self,
        op: Callable[[Any], T],
        fallback: T,
        bounded: bool = False,
        refused: Callable[[Exception], None] | None = None,
    ) -> T:
        """``op(client)``, or ``fallback`` while backing off or when it fails. ``bounded``:
        the whole call (a value's transfer included) gets ``timeout``, not each socket read.
        ``refused`` is told of an error the server answered."""
        if not self._health.available():
            return fallback
        try:
            result = self._bounded(op) if bounded else op(self._client)
        except self._errors.ResponseError as error:  # the server answered: it is up
            self._count("errors", None)
            self._once(type(error).__name__, f"{type(error).__name__}: {error}")
            if refused is not None:
                refused(error)
            return fallback
        except Exception as error:  # connection, timeout, protocol: do not trust the server
            self._count("errors", None)
            self._health.failed(error)
            return fallback
        self._health.succeeded()
        return result

    def _bounded(self, op: Callable[[Any], T]) -> T:
        """``op(client)`` on a reader thread, waited for at most ``timeout``: a value that
        trickles in over a slow link is abandoned (its read ends in the background) and
        counts as a failure, like a server that does not answer."""
        future = self._reads.submit(op, self._client)
        try:
            return future.result(timeout=self._timeout)
        except FutureTimeout:
            raise TimeoutError(f"a read took over {self._timeout} s") from None

    def _once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._answered:
                return
            self._answered.add(kind)
        warnings.warn(
            f"kvboost-rag: the shared KV tier at {self.url} answered an error ({message}); "
            "such operations are skipped, the KV stays in the local tiers",
            stacklevel=5,
        )

    def _count(self, counter: str, entry: Entry | None) -> Entry | None:
        with self._lock:
            self._counts[counter] += 1
        return entry


def import_redis() -> Any:
    try:
        import redis
    except ImportError as error:
        raise ImportError(
            "remote_url needs the Redis client: pip install 'kvboost-rag[redis]'"
        ) from error
    return redis


def redact(url: str) -> str:
    """``url`` without its password (for messages and stats)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _close_at_exit(ref: weakref.ref[RemoteStore]) -> None:
    store = ref()
    if store is not None:
        store.close()
