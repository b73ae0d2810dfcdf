"""Disk tier: KV entries as safetensors files, content-addressed, checksummed, atomic.

Layout: ``cache_dir/<model fingerprint>/<key[:2]>/<key>.safetensors``. A cache made by
another model lives in another folder, and each file's metadata repeats the fingerprint
and key, so a copied or foreign file is never served. Writes go to a temp file that is
fsynced and renamed into place, so readers (other processes included) see whole files or
none. A file that fails to parse or whose checksum does not match is removed with a
warning and reported as a miss, so the caller recomputes it.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from kvboost_rag.core.kv import LayerKV, kv_nbytes
from kvboost_rag.core.store import Entry

FORMAT = "kvboost-kv-2"
_STALE_TEMP_SECONDS = 600  # temp files older than this were left by a killed writer


@dataclass(frozen=True)
class DiskStats:
    entries: int  # files in this model's folder
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
        self._queue: queue.Queue[tuple[bytes, tuple[int, ...], LayerKV]] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._failure: OSError | None = None
        self._pending: set[bytes] = set()  # queued, not yet written
        self._remove_stale_temps()

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
            data = path.read_bytes()
        except FileNotFoundError:
            return self._count(None)
        entry = self._decode(key, data, path)
        if entry is None or (tokens is not None and entry.tokens != tokens):
            return self._count(None)
        _touch(path)
        return self._count(entry)

    def put_later(self, key: bytes, tokens: tuple[int, ...], kv: LayerKV) -> None:
        """Queue a write for the background writer (warming overlaps compute and I/O);
        ``flush()`` waits for queued writes. A queued key reads as absent until written."""
        with self._lock:
            self._pending.add(key)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, daemon=True)
                self._writer.start()
        self._queue.put((key, tokens, kv))

    def flush(self) -> None:
        self._queue.join()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _write_queued(self) -> None:
        while True:
            key, tokens, kv = self._queue.get()
            try:
                self.put(key, tokens, kv)
            except OSError as error:  # raised to the caller by flush()
                self._failure = error
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
        _atomic_write(path, tensors, meta)
        self._enforce_budget()

    def stats(self) -> DiskStats:
        files = list(self.dir.glob("*/*.safetensors"))
        size = sum(_size(f) for f in files)
        return DiskStats(len(files), size, self.max_bytes, self._hits, self._misses, self._corrupt)

    def _decode(self, key: bytes, data: bytes, path: Path) -> Entry | None:
        try:
            meta = _metadata(data)
            tensors = load(data)
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
        path.unlink(missing_ok=True)

    def _count(self, entry: Entry | None) -> Entry | None:
        with self._lock:
            if entry is None:
                self._misses += 1
            else:
                self._hits += 1
        return entry

    def _enforce_budget(self) -> None:
        files = [(f, f.stat()) for f in self.dir.glob("*/*.safetensors") if f.exists()]
        total = sum(s.st_size for _, s in files)
        for f, st in sorted(files, key=lambda fs: fs[1].st_mtime):
            if total <= self.max_bytes:
                break
            f.unlink(missing_ok=True)  # another process may have removed it first
            total -= st.st_size

    def _remove_stale_temps(self) -> None:
        now = time.time()
        for f in self.dir.glob("*/.tmp-*"):
            if now - _mtime(f) > _STALE_TEMP_SECONDS:
                f.unlink(missing_ok=True)


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


def _metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    if header_len <= 0 or 8 + header_len > len(data):
        raise ValueError("truncated file")
    return json.loads(data[8 : 8 + header_len]).get("__metadata__", {})


def _atomic_write(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        os.close(fd)
        save_file(tensors, tmp, metadata=meta)  # streams to the file, no bytes copy
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # mtime orders eviction: least recently used goes first
    except FileNotFoundError:
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()
