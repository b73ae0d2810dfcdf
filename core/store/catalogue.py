"""The passages a disk tier holds, by their token ids: what lets a later process find them
in prompts that do not mark them.

One append-only file per model folder, a record per passage the first time this process
indexes it: a magic, the token count, an xxh64 of the tokens and the tokens (int32). Records
are appended with one ``write`` on a file opened for appending, so processes sharing the
folder interleave whole records; a record cut short (a killed writer) or damaged fails its
checksum and is skipped when read. It holds token ids only, never KV: a record can only make
a prompt look for a passage, whose KV is then read (and checked) from the tiers as ever.
"""

from __future__ import annotations

import os
import struct
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import xxhash

_MAGIC = b"KVP1"
_HEAD = struct.Struct("<4sIQ")  # magic, token count, xxh64 of the token bytes
NAME = "passages.catalogue"


class Catalogue:
    def __init__(self, folder: Path) -> None:
        self.path = folder / NAME
        self._lock = threading.Lock()
        self._failed = False  # one warning per process

    def add(self, tokens: Sequence[int]) -> None:
        body = np.asarray(tokens, dtype=np.int32).tobytes()
        record = _HEAD.pack(_MAGIC, len(tokens), xxhash.xxh64_intdigest(body)) + body
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, record)
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

    def read(self) -> Iterator[tuple[int, ...]]:
        """Every whole, intact record's tokens, in the order written (damage skipped: the
        reader looks for the next magic)."""
        try:
            data = self.path.read_bytes()
        except OSError:
            return
        at = 0
        while (at := data.find(_MAGIC, at)) >= 0:
            if at + _HEAD.size > len(data):
                return
            _, count, digest = _HEAD.unpack_from(data, at)
            body = data[at + _HEAD.size : at + _HEAD.size + 4 * count]
            if len(body) == 4 * count and xxhash.xxh64_intdigest(body) == digest:
                yield tuple(np.frombuffer(body, np.int32).tolist())
                at += _HEAD.size + len(body)
            else:
                at += 1
