"""The disk tier's budget bookkeeping: each file's size in least-recently-used order, kept
up to date as files are written, read and removed, so the budget never lists the folder."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path


class FolderIndex:
    """Sizes of a store's files, least recently used first. Not locked: its store calls
    it under the store's lock."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.bytes = 0
        self._sizes: OrderedDict[Path, int] = OrderedDict()
        self.scan()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, path: Path) -> bool:
        return path in self._sizes

    def scan(self) -> None:
        """Rebuild from the folder, ordered by mtime (reads touch it, so it is LRU order)."""
        found: list[tuple[float, Path, int]] = []
        for path in self.folder.glob("*/*.safetensors"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, path, st.st_size))
        found.sort()
        self._sizes = OrderedDict((path, size) for _, path, size in found)
        self.bytes = sum(self._sizes.values())

    def used(self, path: Path, size: int) -> None:
        """``path`` (``size`` bytes) was just written or read: the most recently used."""
        self.bytes += size - self._sizes.pop(path, 0)
        self._sizes[path] = size

    def removed(self, path: Path) -> None:
        self.bytes -= self._sizes.pop(path, 0)

    def oldest(self) -> Path:
        return next(iter(self._sizes))
