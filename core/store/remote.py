"""Shared tier: KV entries in Redis, Valkey or a Redis Cluster, warmed once for every machine.

Keys are ``<namespace>:<model fingerprint>:<cache key>`` and values are ``codec`` entries
(safetensors, checksummed, never pickle), so a value written by another model, a damaged
or a truncated one is dropped with a warning and recomputed. A SET is atomic: readers see
a whole value or none, and concurrent writers of one key each write a whole valid value.
On a cluster (``redis_client``) keys shard by hash slot over the masters.

Reads and writes go in batches: a request's lookup (``get_many``, ``contains_many``) is one
pipeline per server or cluster node, every node's sent at once. The background writer
sends what is queued as one pipeline of EXISTS, then one of SETs for the values not there
yet. ``RemoteStats`` counts the flights at the client (``round_trips``).

The server evicts by its own policy (``maxmemory`` + ``allkeys-lru``): a vanished key is a
miss. Writes go through a background ``BatchWriter``, never the request path; a key
already present is not sent again, and a value over the server's ``proto-max-bulk-len`` is
skipped.

Faults never reach the caller (``remote_link`` keeps the rules, per node): a server or a
cluster node that is down, slow, restarting or failing over makes its keys misses for a
back-off (0.5 s, doubling to 30 s), one warning per outage of the tier. A read on the
request path gets ``timeout`` in all, its whole batch included (a value trickling in over
a slow link is abandoned, not waited for); background writes get it per socket operation.
An error a node answers (out of memory, read-only replica) is warned about once per kind,
and its writes pause for a back-off of their own. MOVED and ASK redirections while a slot
migrates, and a failover's new layout, are followed by the cluster client. Requests go on
from the local tiers; values that came back from healthy nodes are used, each checked like
any other.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_rag.core.caller_warnings import warn
from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.remote_url import redact
from kvboost_rag.core.store import codec
from kvboost_rag.core.store.catalogue import SharedCatalogue
from kvboost_rag.core.store.memory import Entry
from kvboost_rag.core.store.redis_client import import_redis
from kvboost_rag.core.store.remote_link import RemoteLink
from kvboost_rag.core.store.writer import BatchWriter

__all__ = ["RemoteStats", "RemoteStore", "import_redis", "redact"]

DEFAULT_MAX_VALUE = 512 * 1024**2  # Redis's proto-max-bulk-len default
WRITE_BATCH = 32  # queued writes sent together (one EXISTS and one SET pipeline)
WRITE_BYTES = 64 * 1024**2  # values per SET pipeline, at most
_Write = tuple[bytes, tuple[int, ...], LayerKV, bool]


@dataclass(frozen=True)
class RemoteStats:
    url: str  # the server or the cluster's seed nodes, password removed
    available: bool  # False from a failure until the failed node answers again
    hits: int
    misses: int  # absent, evicted, or skipped while the server was unavailable
    corrupt: int  # values found damaged or foreign, deleted
    writes: int  # values written
    written_bytes: int
    skipped: int  # writes not sent: already present, too large, or server unavailable
    errors: int  # calls that failed (connection, timeout, or an error the server answered)
    round_trips: int  # command flights sent, counted at the client (a batch: one per node)
    connections: int  # connections opened (their setup flights are not in round_trips)


class RemoteStore:
    """Thread-safe; any number of processes and machines may share one server or cluster.
    The shared ``Tier``: every passage and exact prefix block is written through to it."""

    name = "remote"
    shared = True
    batched = True
    write_through = True

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
        self._link = RemoteLink(url, timeout)
        self.url = self._link.url
        self.fingerprint = fingerprint.hex()
        self.codec = kv_codec
        self._secret = secret  # signs every value written; values read must carry it
        self._prefix = f"{namespace}:{self.fingerprint}:".encode()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "writes", "written_bytes", "skipped"), 0
        )
        self._max_value: int | None = None
        self._pending: set[bytes] = set()
        self._writer: BatchWriter[_Write] = BatchWriter(
            "kvboost-redis-writer", self._write, WRITE_BATCH
        )
        self._catalogue = self._prefix + b"passages"  # no hex name of a value spells it
        self._records: BatchWriter[bytes] = BatchWriter(
            "kvboost-redis-catalogue", self._append, WRITE_BATCH
        )
        atexit.register(_close_at_exit, weakref.ref(self))

    def value_name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def get(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        return self.get_many([(key, tokens)])[0]

    def get_many(self, items: Sequence[tuple[bytes, tuple[int, ...] | None]]) -> list[Entry | None]:
        """Per ``(key, tokens)``, the entry stored under ``key`` if its tokens equal
        ``tokens`` (``None``: not compared): one batch, bounded by ``timeout`` in all."""
        keys = list(dict.fromkeys(key for key, _ in items))
        if not keys:
            return []
        names = [self.value_name(key) for key in keys]
        answers = self._link.pipeline("get", names, bounded=True)
        damaged: list[bytes] = []
        entries = {key: self._decode(key, data, damaged) for key, data in zip(keys, answers)}
        if damaged:  # dropped, so the KV recomputed here replaces them
            self._link.pipeline("delete", damaged)
        out = [_matching(entries[key], tokens) for key, tokens in items]
        found = sum(entry is not None for entry in out)
        with self._lock:
            self._counts["hits"] += found
            self._counts["misses"] += len(out) - found
        return out

    def __contains__(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored or queued for writing (reads no value): one batch."""
        with self._lock:
            queued = [key in self._pending for key in keys]
        ask = list(dict.fromkeys(k for k, q in zip(keys, queued) if not q))
        if not ask:
            return queued
        names = [self.value_name(key) for key in ask]
        answers = self._link.pipeline("exists", names, bounded=True)
        found = {key: bool(answer) for key, answer in zip(ask, answers)}
        return [q or found[key] for key, q in zip(keys, queued)]

    def put_later(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> None:
        """Queue a write-through; ``flush()`` waits for it. Nothing is raised: a write that
        cannot be made is counted and the entry stays in the local tiers."""
        with self._lock:
            self._pending.add(key)
        if not self._writer.submit((key, tokens, kv, approximate)):
            self._write([(key, tokens, kv, approximate)])

    def spill(self, key: bytes, entry: Entry) -> None:
        """Nothing: what the shared tier should hold was written through when stored."""

    def catalogue(self) -> SharedCatalogue:
        return SharedCatalogue(self)

    def append_later(self, record: bytes) -> None:
        """Queue a catalogue record (``catalogue.SharedCatalogue``): appended to the list
        every replica of this model reads, after the values queued before it."""
        if not self._records.submit(record):
            self._append([record])

    def records_since(self, start: int, limit: int) -> tuple[int, list[bytes]] | None:
        """The catalogue's length and up to ``limit`` records from ``start`` on (one round
        trip); None while the tier is unavailable."""
        name = self._catalogue
        return self._link.call(lambda client: _range(client, name, start, limit), None)

    def flush(self) -> None:
        """Wait until queued writes were sent (or skipped)."""
        self._writer.join()
        self._records.join()

    def close(self) -> None:
        self._writer.close()
        self._records.close()

    def stats(self) -> RemoteStats:
        with self._lock:
            counts = dict(self._counts)
        return RemoteStats(
            self.url,
            self._link.available(),
            **counts,
            errors=self._link.errors,
            round_trips=self._link.round_trips.count,
            connections=self._link.round_trips.connections,
        )

    def _decode(self, key: bytes, data: bytes | None, damaged: list[bytes]) -> Entry | None:
        """The entry in ``data`` (None when absent); a damaged or foreign value is warned
        about, counted and its name added to ``damaged``."""
        if data is None:
            return None
        try:
            return codec.from_bytes(data, key, self.fingerprint, self._secret)
        except ValueError as error:
            warn(
                f"kvboost-rag: dropping damaged shared cache value {self.value_name(key).decode()} "
                f"({error}); its KV will be recomputed"
            )
            self._count("corrupt")
            damaged.append(self.value_name(key))
            return None

    def _write(self, items: list[_Write]) -> None:
        try:
            self._send(list({item[0]: item for item in items}.values()))  # once per key
        finally:
            with self._lock:
                self._pending.difference_update(item[0] for item in items)

    def _send(self, items: list[_Write]) -> None:
        """Write the values not stored yet: one EXISTS pipeline, then SET pipelines."""
        names = [self.value_name(item[0]) for item in items]
        present = self._link.pipeline("exists", names, write=True)
        absent = [(item, n) for item, n, there in zip(items, names, present) if there == 0]
        # Skipped: another writer was first, or the node is unavailable or refusing writes.
        self._count("skipped", len(items) - len(absent))
        values = [(name, self._encoded(item)) for item, name in absent]
        fitting = [(name, data) for name, data in values if data is not None]
        self._count("skipped", len(values) - len(fitting))
        for batch in _batches(fitting, WRITE_BYTES):
            self._set(batch)

    def _encoded(self, item: _Write) -> bytes | None:
        """``item`` as a stored value; None (warned once) when over the server's limit."""
        key, tokens, kv, approximate = item
        data = codec.to_bytes(
            key, self.fingerprint, tokens, kv, self.codec, approximate, self._secret
        )
        if len(data) > self._value_limit():
            self._link.warn_once(
                "too-large", f"a {len(data)}-byte value is over the server's limit"
            )
            return None
        return data

    def _set(self, batch: list[tuple[bytes, bytes]]) -> None:
        names, values = [name for name, _ in batch], [data for _, data in batch]
        answers = self._link.pipeline("set", names, values, write=True)
        written = [len(data) for (_, data), ok in zip(batch, answers) if ok]
        with self._lock:
            self._counts["writes"] += len(written)
            self._counts["written_bytes"] += sum(written)
            self._counts["skipped"] += len(batch) - len(written)

    def _append(self, records: list[bytes]) -> None:
        self._writer.join()  # the values first: a record read says the value is there
        self._link.pipeline("rpush", [self._catalogue] * len(records), records, write=True)

    def _value_limit(self) -> int:
        if self._max_value is None:
            found = self._link.call(lambda client: _setting(client, "proto-max-bulk-len"), None)
            self._max_value = int(found) if found else DEFAULT_MAX_VALUE
        return self._max_value

    def _count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self._counts[counter] += n


def _matching(entry: Entry | None, tokens: tuple[int, ...] | None) -> Entry | None:
    return None if entry is None or (tokens is not None and entry.tokens != tokens) else entry


def _range(client: Any, name: bytes, start: int, limit: int) -> tuple[int, list[bytes]]:
    pipe = client.pipeline(transaction=False)
    pipe.llen(name)
    pipe.lrange(name, start, start + limit - 1)
    length, records = pipe.execute()
    return int(length), list(records)


def _setting(client: object, name: str) -> str | None:
    """A server setting (a cluster's: any node's, they are set alike)."""
    found = client.config_get(name)  # type: ignore[attr-defined]
    if found and name not in found:  # a cluster may answer per node
        found = next(iter(found.values()))
    value = found.get(name)
    return None if value is None else str(value)


def _batches(values: list[tuple[bytes, bytes]], limit: int) -> list[list[tuple[bytes, bytes]]]:
    """``values`` in consecutive runs of at most ``limit`` bytes (one value at least)."""
    out: list[list[tuple[bytes, bytes]]] = []
    size = limit
    for name, data in values:
        if size + len(data) > limit:
            out.append([])
            size = 0
        out[-1].append((name, data))
        size += len(data)
    return out


def _close_at_exit(ref: weakref.ref[RemoteStore]) -> None:
    store = ref()
    if store is not None:
        store.close()
