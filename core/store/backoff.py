"""Back-off for a server that failed: skip it for a while, longer while it keeps failing."""

from __future__ import annotations

import threading
import time


class Backoff:
    """When a server (or a cluster node) fails: skip it for a delay that doubles while it
    keeps failing, from ``first`` to ``longest`` seconds. Thread-safe. Saying so is the
    caller's: one warning per outage of the whole tier (``RemoteLink``)."""

    def __init__(self, first: float = 0.5, longest: float = 30.0) -> None:
        self.first, self.longest = first, longest
        self._delay = first
        self._retry_at = 0.0
        self._down = False
        self._lock = threading.Lock()

    def available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._retry_at

    @property
    def down(self) -> bool:
        """Whether the last call failed (it may be retried already)."""
        with self._lock:
            return self._down

    def failed(self) -> None:
        with self._lock:
            self._down = True
            self._retry_at = time.monotonic() + self._delay
            self._delay = min(self._delay * 2, self.longest)

    def succeeded(self) -> None:
        with self._lock:
            self._down, self._delay = False, self.first
