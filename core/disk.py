"""Disk tier: KV entries as safetensors files, content-addressed, checksummed, atomic.

Layout: ``cache_dir/<model fingerprint>/<key[:2]>/<key>.safetensors``. A cache made by
another model lives in another folder, and each file's metadata repeats the fingerprint
and key, so a copied or foreign file is never served. Writes go to a temp file that is
fsynced and renamed into place, so readers (other processes included) see whole files or
none. A file that fails to parse or whose checksum does not match is removed with a
warning and reported as a miss, so the caller recomputes it.

The byte budget is kept by an in-memory index of the folder (sizes in least-recently-used
order), built by one scan when the store opens and updated on each write, read and
removal, so a write never lists the folder. Other processes may add or remove files
meanwhile: files found by a read join the index, and the folder is scanned again only
when the index proves wrong (a file it would evict is already gone).

Queued writes are drained when the interpreter exits (an ``atexit`` hook per store, held
through a weak reference): the writer is a daemon thread, and a daemon thread still inside
torch/safetensors code while the interpreter finalizes aborts the process ("FATAL:
exception not rethrown"). Draining in ``atexit`` rather than making the writer non-daemon
adds no idle wait to every exit and gives one place to report a write that failed.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from kvboost_rag.core.folder_index import FolderIndex
from kvboost_rag.core.kv import LayerKV, kv_nbytes
from kvboost_rag.core.store import Entry

FORMAT = "kvboost-kv-2"
_STALE_TEMP_SECONDS = 600  # temp files older than this were left by a killed writer
_WRITER_IDLE_SECONDS = 5.0  # the writer ends after this long without work (frees the store)
_STOP = None  # queued to end the writer

_Write = tuple[bytes, tuple[int, ...], LayerKV]


@dataclass(frozen=True)
class DiskStats:
    entries: int  # files in this model's folder, as this store tracks them
    bytes: int  # their size
    max_bytes: int  # the budget; oldest-used files are removed past it
    hits: int
    misses: int
    corrupt: int  # files found damaged or foreign, removed


class DiskStore:
    """Thread-safe within a process; safe across processes sharing ``root``."""

    def __init__(self, root: str | Path, fingerprint: bytes, max_bytes: int) -> None:
        self.dir = Path(root) / fingerprint.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint.hex()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._hits = self._misses = self._corrupt = 0
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._failures: list[tuple[Path, Exception]] = []  # raised by flush()
        self._pending: set[bytes] = set()  # queued, not yet written
        self._closed = False  # after close(), writes are synchronous
        self._remove_stale_temps()
        self._index = FolderIndex(self.dir)
        atexit.register(_close_at_exit, weakref.ref(self))

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}.safetensors"

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._pending:
                return True
        return self.path(key).exists()

    def get(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        path = self.path(key)
        try:
            size = path.stat().st_size
            entry = self._decode(key, path)
        except FileNotFoundError:
            return self._count(None)
        if entry is None or (tokens is not None and entry.tokens != tokens):
            return self._count(None)
        _touch(path)
        with self._lock:
            self._index.used(path, size)
        return self._count(entry)

    def put_later(self, key: bytes, tokens: tuple[int, ...], kv: LayerKV) -> None:
        """Queue a write for the background writer (warming overlaps compute and I/O);
        ``flush()`` waits for queued writes. A queued key reads as absent until written."""
        with self._lock:
            if not self._closed:
                self._pending.add(key)
                self._queue.put((key, tokens, kv))  # under the lock: see _write_queued
                if self._writer is None:
                    self._writer = threading.Thread(
                        target=self._write_queued, name="kvboost-disk-writer", daemon=True
                    )
                    self._writer.start()
                return
        self.put(key, tokens, kv)

    def flush(self) -> None:
        """Wait until queued writes are on disk; raise the first write that failed."""
        self._queue.join()
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            path, error = failures[0]
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            raise OSError(f"kvboost-rag: could not write {path}{more}: {error}") from error

    def close(self) -> None:
        """Write what is queued, then end the writer; later writes are synchronous.
        Called at interpreter exit; a write that fails then is reported as a warning."""
        with self._lock:
            self._closed = True
            writer, self._writer = self._writer, None
            if writer is not None:
                self._queue.put(_STOP)
        if writer is not None:
            writer.join()
        self.flush()

    def _write_queued(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_WRITER_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:  # put_later and close queue under this lock: none is missed
                    if self._queue.empty():
                        # Ending drops the thread's reference, so an unused store is freed.
                        self._writer = None
                        return
                continue
            if item is _STOP:
                self._queue.task_done()
                return
            self._write(*item)

    def _write(self, key: bytes, tokens: tuple[int, ...], kv: LayerKV) -> None:
        try:
            self.put(key, tokens, kv)
        except Exception as error:  # not swallowed: flush() raises it to the caller
            with self._lock:
                self._failures.append((self.path(key), error))
        finally:
            with self._lock:
                self._pending.discard(key)
            self._queue.task_done()

    def put(self, key: bytes, tokens: tuple[int, ...], kv: LayerKV) -> None:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32)}
        for i, (k, v) in enumerate(kv):
            tensors[f"k{i}"], tensors[f"v{i}"] = k.contiguous().cpu(), v.contiguous().cpu()
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "key": key.hex(),
            "layers": str(len(kv)),
            "checksum": _checksum(tensors),
        }
        size = _atomic_write(path, tensors, meta)
        with self._lock:
            self._index.used(path, size)
            self._enforce_budget()

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(
                len(self._index),
                self._index.bytes,
                self.max_bytes,
                self._hits,
                self._misses,
                self._corrupt,
            )

    def _decode(self, key: bytes, path: Path) -> Entry | None:
        try:
            # Memory-mapped: one copy from the page cache into tensors (reading the bytes
            # first and parsing them made two; measured 1.6 -> 1.1 ms per 2.7 MB passage).
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            ok = (
                meta.get("format") == FORMAT
                and meta.get("fingerprint") == self.fingerprint
                and meta.get("key") == key.hex()
                and meta.get("checksum") == _checksum(tensors)
            )
            if not ok:
                raise ValueError("checksum, key or model fingerprint does not match")
            layers = int(meta["layers"])
            kv = [(tensors[f"k{i}"], tensors[f"v{i}"]) for i in range(layers)]
        except (SafetensorError, ValueError, KeyError, json.JSONDecodeError) as error:
            self._discard(path, error)
            return None
        return Entry(tuple(tensors["tokens"].tolist()), kv, kv_nbytes(kv))

    def _discard(self, path: Path, error: Exception) -> None:
        warnings.warn(
            f"kvboost-rag: removing damaged cache file {path} ({error}); its KV will be recomputed",
            stacklevel=4,
        )
        with self._lock:
            self._corrupt += 1
            self._index.removed(path)
        path.unlink(missing_ok=True)

    def _count(self, entry: Entry | None) -> Entry | None:
        with self._lock:
            if entry is None:
                self._misses += 1
            else:
                self._hits += 1
        return entry

    def _enforce_budget(self) -> None:
        """Remove least recently used files until the folder fits; called under the lock."""
        rescanned = False
        while self._index.bytes > self.max_bytes and len(self._index):
            path = self._index.oldest()
            self._index.removed(path)
            try:
                path.unlink()
            except FileNotFoundError:  # another process removed it: the index is stale
                if not rescanned:
                    self._index.scan()
                    rescanned = True

    def _remove_stale_temps(self) -> None:
        now = time.time()
        for f in self.dir.glob("*/.tmp-*"):
            if now - _mtime(f) > _STALE_TEMP_SECONDS:
                f.unlink(missing_ok=True)


def _close_at_exit(ref: weakref.ref[DiskStore]) -> None:
    store = ref()
    if store is None:
        return
    try:
        store.close()
    except OSError as error:
        warnings.warn(f"{error}; its KV was not cached", stacklevel=1)


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    # xxh3 hashes the tensors' memory in place at memory speed: a serving process checks
    # every file it reads, so a slower hash would show up in TTFT.
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return h.hexdigest()


def _atomic_write(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> int:
    """Write the file whole or not at all; returns its size."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        # Serialized in memory, then written with a file write, which releases the GIL
        # while the kernel takes the bytes: save_file writes while holding it, so a write
        # the kernel throttles (GiBs of dirty pages while warming a corpus) also stops the
        # encoding thread. One extra 2.7 MB copy per passage is the price.
        data = save(tensors, metadata=meta)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return len(data)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # mtime orders eviction: least recently used goes first
    except FileNotFoundError:
        pass


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()
