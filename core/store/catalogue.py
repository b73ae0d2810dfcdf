"""The passages a tier holds, by their token ids: what lets another process find them in
prompts that do not mark them.

A record per passage: a magic, the token count, an xxh64 of the tokens and the tokens
(int32). It holds token ids only, never KV: a record can only make a prompt look for a
passage, whose KV is then read (and checked) from the tiers as ever.

- ``Catalogue``: one append-only file per disk tier's model folder. Records are appended
  with one ``write`` on a file opened for appending, so processes sharing the folder
  interleave whole records; a record cut short (a killed writer) or damaged fails its
  checksum and is skipped.
- ``SharedCatalogue``: one list per model in the shared tier (Redis / Redis Cluster), a
  record per element, so replicas learn of passages any of them warmed or encoded.

Both are read incrementally: ``read_new`` gives the records written since its last call,
by this process or any other, so a long-running server keeps learning.
"""

from __future__ import annotations

import os
import struct
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

_MAGIC = b"KVP1"
_HEAD = struct.Struct("<4sIQ")  # magic, token count, xxh64 of the token bytes
NAME = "passages.catalogue"
Tokens = tuple[int, ...]


def record(tokens: Sequence[int]) -> bytes:
    body = np.asarray(tokens, dtype=np.int32).tobytes()
    return _HEAD.pack(_MAGIC, len(tokens), xxhash.xxh64_intdigest(body)) + body


def parse(data: bytes) -> tuple[list[Tokens], int]:
    """The whole, intact records in ``data`` in order, and where an unfinished last one
    starts (``len(data)`` if none): damage is skipped by looking for the next magic; a
    record running past the end is unfinished unless another record follows it."""
    found: list[Tokens] = []
    at = 0
    while (at := data.find(_MAGIC, at)) >= 0:
        if at + _HEAD.size > len(data):
            return found, at
        _, count, digest = _HEAD.unpack_from(data, at)
        end = at + _HEAD.size + 4 * count
        if end > len(data) and data.find(_MAGIC, at + 1) < 0:
            return found, at  # being written (or cut short by a writer killed last)
        body = data[at + _HEAD.size : end]
        if len(body) == 4 * count and xxhash.xxh64_intdigest(body) == digest:
            found.append(tuple(np.frombuffer(body, np.int32).tolist()))
            at = end
        else:
            at += 1
    return found, len(data)


class Catalogue:
    """Thread-safe."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / NAME
        self._lock = threading.Lock()
        self._read_at = 0  # bytes of the file already read
        self._failed = False  # one warning per process

    def add(self, tokens: Sequence[int]) -> None:
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, record(tokens))
                finally:
                    os.close(fd)
        except OSError as error:
            if not self._failed:
                self._failed = True
                warnings.warn(
                    f"cannot append to {self.path} ({error}): passages stored now are found "
                    "unmarked by this process only",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def read_new(self) -> list[Tokens]:
        """The records written since the last call (this process's own included)."""
        with self._lock:
            data = self._bytes(self._read_at)
            found, done = parse(data)
            self._read_at += done
        return found

    def _bytes(self, start: int) -> bytes:
        try:
            with open(self.path, "rb") as file:
                file.seek(start)
                return file.read()
        except OSError:
            return b""


class RecordList(Protocol):
    """A shared tier's list of catalogue records (``RemoteStore``)."""

    def append_later(self, record: bytes) -> None: ...

    def records_since(self, start: int, limit: int) -> tuple[int, list[bytes]] | None:
        """The list's length and up to ``limit`` of its elements from ``start`` on; None
        when unreachable."""


class SharedCatalogue:
    """Thread-safe. The list only grows; if the server evicted it (it is a key like any
    other), it is read again from its start as it fills again."""

    PAGE = 4096  # records per round trip (~4 MB of 250-token passages)

    def __init__(self, tier: RecordList) -> None:
        self._tier = tier
        self._lock = threading.Lock()
        self._read_at = 0  # elements of the list already read

    def add(self, tokens: Sequence[int]) -> None:
        self._tier.append_later(record(tokens))

    def read_new(self) -> list[Tokens]:
        found: list[Tokens] = []
        with self._lock:
            while (page := self._page()) is not None:
                found += [tokens for data in page for tokens in parse(data)[0]]
                if len(page) < self.PAGE:
                    break
        return found

    def _page(self) -> list[bytes] | None:
        """The next records (under ``_lock``); None when unreachable."""
        answer = self._tier.records_since(self._read_at, self.PAGE)
        if answer is not None and answer[0] < self._read_at:  # evicted, begun again
            self._read_at = 0
            answer = self._tier.records_since(0, self.PAGE)
        if answer is None:
            return None
        self._read_at += len(answer[1])
        return answer[1]


class Catalogues:
    """Several catalogues read and written as one (a disk tier's and a shared tier's)."""

    def __init__(self, catalogues: Sequence[Catalogue | SharedCatalogue]) -> None:
        self.catalogues = list(catalogues)

    def add(self, tokens: Sequence[int]) -> None:
        for catalogue in self.catalogues:
            catalogue.add(tokens)

    def read_new(self) -> list[Tokens]:
        return [tokens for catalogue in self.catalogues for tokens in catalogue.read_new()]
