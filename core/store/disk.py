"""Disk tier: KV entries as safetensors files, content-addressed, checksummed, atomic.

Layout: ``cache_dir/<model fingerprint>/<key[:2]>/<key>.safetensors``. A cache made by
another model lives in another folder, and each file's metadata repeats the fingerprint
and key, so a copied or foreign file is never served. Writes go to a temp file that is
fsynced and renamed into place, so readers (other processes included) see whole files or
none. Files are read whole into memory, not memory-mapped: a mapped file truncated in
place while read kills the process with SIGBUS. A file that fails to parse or whose
checksum does not match is removed with a warning and reported as a miss, so the caller
recomputes it; one that cannot be read (permissions, I/O error) is a miss with a warning.

The byte budget is kept by an in-memory index of the folder (sizes in least-recently-used
order), built by one scan when the store opens and updated on each write, read and
removal, so a write never lists the folder. Other processes may add or remove files
meanwhile: files found by a read join the index, and the folder is scanned again only
when the index proves wrong (a file it would evict is already gone).

Queued writes go through a background ``Writer`` and are drained at interpreter exit (an
``atexit`` hook per store, held through a weak reference). A write that fails (disk full,
read-only folder, folder removed) never fails a request: the KV stays in memory, the first
failure since the last ``flush()`` is a warning, and ``flush()`` raises it. A folder that
cannot be made at all when the store opens (a file there, no permission) is an
``OSError`` then: ``open_tiers`` turns the disk tier off with one warning. Entries are
``codec`` blobs: an optional lossy codec applies to approximate (passage, session) KV only.
"""

from __future__ import annotations

import atexit
import os
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.store import codec
from kvboost_rag.core.store.catalogue import Catalogue
from kvboost_rag.core.store.folder_index import FolderIndex
from kvboost_rag.core.store.memory import Entry
from kvboost_rag.core.store.writer import Writer, halted

_STALE_TEMP_SECONDS = 600  # temp files older than this were left by a killed writer

_Write = tuple[bytes, tuple[int, ...], LayerKV, bool]


@dataclass(frozen=True)
class DiskStats:
    entries: int  # files in this model's folder, as this store tracks them
    bytes: int  # their size
    max_bytes: int  # the budget; oldest-used files are removed past it
    hits: int
    misses: int
    corrupt: int  # files found damaged or foreign, removed


class DiskStore:
    """Thread-safe within a process; safe across processes sharing ``root``. Raises
    ``OSError`` when the model's folder under ``root`` cannot be made. A ``Tier`` that
    keeps what is warmed, promoted from the shared tier or evicted from memory."""

    name = "disk"
    shared = False
    batched = False
    write_through = False

    def __init__(
        self,
        root: str | Path,
        fingerprint: bytes,
        max_bytes: int,
        kv_codec: str = "none",
        secret: bytes | None = None,
    ) -> None:
        self.dir = Path(root) / fingerprint.hex()
        self.fingerprint = fingerprint.hex()
        self.max_bytes = max_bytes
        self.codec = kv_codec
        self._secret = secret  # signs every entry written; entries read must carry it
        self._lock = threading.Lock()
        self._hits = self._misses = self._corrupt = 0
        self._writer: Writer[_Write] = Writer("kvboost-disk-writer", self._write)
        self._failure: tuple[Path, Exception] | None = None  # the first since flush()
        self._failed = 0  # writes failed since flush()
        self._reserved = 0  # bytes of the files being written now
        self._pending: set[bytes] = set()  # queued, not yet written
        self._make_folder()
        self._index = FolderIndex(self.dir)
        atexit.register(_close_at_exit, weakref.ref(self))

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}.safetensors"

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._pending:
                return True
        return os.path.exists(self.path(key))  # False, not an error, when unreadable

    def get(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        path = self.path(key)
        found = self._load(key, path)
        if found is None or (tokens is not None and found[0].tokens != tokens):
            return self._count(None)
        _touch(path)
        with self._lock:  # our evictions unlink under this lock: the check below holds
            if path in self._index or path.exists():  # not one evicted while it was read
                self._index.used(path, found[1])
                self._enforce_budget()  # a file another process wrote counts from now
        return self._count(found[0])

    def get_many(self, items: Sequence[tuple[bytes, tuple[int, ...] | None]]) -> list[Entry | None]:
        return [self.get(key, tokens) for key, tokens in items]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self for key in keys]

    def catalogue(self) -> Catalogue:
        return Catalogue(self.dir)

    def put_later(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> None:
        """Queue a write for the background writer (warming overlaps compute and I/O);
        ``flush()`` waits for queued writes. A key already on disk (or queued) is skipped."""
        if key in self:
            return
        with self._lock:
            self._pending.add(key)
        if not self._writer.submit((key, tokens, kv, approximate)):  # closed: write now
            self._write((key, tokens, kv, approximate))

    def spill(self, key: bytes, entry: Entry) -> None:
        """A memory eviction, written now unless the file is there already."""
        if key not in self:  # a failed write must not fail the request evicting it
            self.put_or_report(key, entry.tokens, entry.kv, entry.approximate)

    def put_or_report(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> None:
        """``put``, for callers a failed write must not fail (a memory eviction, the
        writer thread): the KV is just not on disk; the first failure since ``flush()``
        is a warning, and ``flush()`` raises it."""
        try:
            self.put(key, tokens, kv, approximate)
        except Exception as error:  # not swallowed: warned, and raised by flush()
            with self._lock:
                self._failed += 1
                first = self._failure is None
                if first:
                    self._failure = (self.path(key), error)
            if first:
                message = f"{_failed_message(self.path(key), error)}; its KV is kept in memory only"
                warnings.warn(message, stacklevel=2)

    def flush(self) -> None:
        """Wait until queued writes are on disk; raise the first write that failed."""
        self._writer.join()
        with self._lock:
            failure, failed = self._failure, self._failed
            self._failure, self._failed = None, 0
        if failure is not None:
            path, error = failure
            more = f" (and {failed - 1} more)" if failed > 1 else ""
            raise OSError(_failed_message(path, error, more)) from error

    def close(self) -> None:
        """Write what is queued, then end the writer; later writes are synchronous.
        Called at interpreter exit; a write that fails then is reported as a warning."""
        self._writer.close()
        self.flush()

    def _write(self, item: _Write) -> None:
        try:
            self.put_or_report(*item)
        finally:
            with self._lock:
                self._pending.discard(item[0])

    def put(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> None:
        if halted():  # the process is ending (Ctrl-C): a memory eviction writes nothing either
            return
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)  # the folder may have been removed
        data = codec.to_bytes(
            key, self.fingerprint, tokens, kv, self.codec, approximate, self._secret
        )
        if halted():  # checked again after the encoding, the long part
            return
        with self._lock:  # room first, so the folder holds the budget even mid-write
            self._reserved += len(data)
            self._enforce_budget()
        try:
            size = _atomic_write(path, data)
        except BaseException:
            with self._lock:
                self._reserved -= len(data)
            raise
        with self._lock:
            self._reserved -= len(data)
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

    def _load(self, key: bytes, path: Path) -> tuple[Entry, int] | None:
        """The entry in ``path`` and the file's size; None when it is missing, unreadable
        or damaged (then removed)."""
        try:
            data = _read(path)
        except FileNotFoundError:
            return None
        except OSError as error:  # kept: it may be another user's, or the disk may recover
            warnings.warn(
                f"kvboost-rag: cannot read cache file {path} ({error}); its KV will be recomputed",
                stacklevel=3,
            )
            return None
        try:
            return codec.from_buffer(data, key, self.fingerprint, self._secret), len(data)
        except ValueError as error:
            self._discard(path, error)
            return None

    def _discard(self, path: Path, error: Exception) -> None:
        with self._lock:
            self._corrupt += 1
            self._index.removed(path)
        try:
            path.unlink(missing_ok=True)
            action = "removing"
        except OSError as unlink_error:  # a read-only folder: it stays, and stays unserved
            action = f"cannot remove ({unlink_error})"
        warnings.warn(
            f"kvboost-rag: {action} damaged cache file {path} ({error}); its KV will be recomputed",
            stacklevel=4,
        )

    def _count(self, entry: Entry | None) -> Entry | None:
        with self._lock:
            if entry is None:
                self._misses += 1
            else:
                self._hits += 1
        return entry

    def _enforce_budget(self) -> None:
        """Remove least recently used files until the folder fits, room for the files
        being written included; called under the lock."""
        rescanned = False
        while self._index.bytes + self._reserved > self.max_bytes and len(self._index):
            path = self._index.oldest()
            self._index.removed(path)
            try:
                path.unlink()
            except FileNotFoundError:  # another process removed it: the index is stale
                if not rescanned:
                    self._index.scan()
                    rescanned = True
            except OSError as error:  # not ours to remove (sticky folder, read-only mount)
                message = f"kvboost-rag: cannot evict cache file {path} ({error})"
                warnings.warn(message, stacklevel=4)

    def _make_folder(self) -> None:
        """Create the folder (``OSError`` when it cannot be) and remove temp files killed
        writers left."""
        self.dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        for f in self.dir.glob("*/.tmp-*"):
            if now - _mtime(f) > _STALE_TEMP_SECONDS:
                try:
                    f.unlink(missing_ok=True)
                except OSError:  # a read-only folder: harmless, readers never open temps
                    pass


def _close_at_exit(ref: weakref.ref[DiskStore]) -> None:
    store = ref()
    if store is None:
        return
    try:
        store.close()
    except OSError as error:  # the process ends: what was kept in memory is gone now
        warnings.warn(f"{error}; that KV is not on disk", stacklevel=1)


def _failed_message(path: Path, error: Exception, more: str = "") -> str:
    return f"kvboost-rag: could not write {path}{more}: {error}"


def _read(path: Path) -> bytearray:
    """The whole file (one copy from the page cache, which measured faster than mapping it
    and copying tensors out: 0.9 vs 3.5 ms per 5.5 MB entry). Short when it shrank while
    read, which parsing then rejects."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        read = f.readinto(data)
    del data[read:]
    return data


def _atomic_write(path: Path, data: bytes) -> int:
    """Write the file whole or not at all; returns its size."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        # Serialized in memory (codec.to_bytes), then written with a file write, which
        # releases the GIL while the kernel takes the bytes: save_file writes while holding
        # it, so a write the kernel throttles (GiBs of dirty pages while warming a corpus)
        # also stops the encoding thread. One extra 2.7 MB copy per passage is the price.
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
    except OSError:  # removed, or another user's file: only its eviction order is stale
        pass


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()
