"""Back-off for a server that failed: skip it for a while, longer while it keeps failing."""

from __future__ import annotations

import logging
import threading
import time
import warnings

log = logging.getLogger("kvboost_rag")


class Backoff:
    """When a server fails: skip it for a delay that doubles while it keeps failing; one
    warning per outage. Thread-safe."""

    def __init__(
        self, where: str, first: float = 0.5, longest: float = 30.0, warn: bool = True
    ) -> None:
        self.where = where
        self.warn = warn
        self.first, self.longest = first, longest
        self._delay = first
        self._retry_at = 0.0
        self._down = False
        self._lock = threading.Lock()

    def available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._retry_at

    def failed(self, error: Exception) -> None:
        with self._lock:
            if not self._down and self.warn:
                warnings.warn(
                    f"kvboost-rag: the shared KV tier at {self.where} is unavailable ({error}); "
                    "serving from local tiers, retrying in the background",
                    stacklevel=5,
                )
            self._down = True
            self._retry_at = time.monotonic() + self._delay
            self._delay = min(self._delay * 2, self.longest)

    def succeeded(self) -> None:
        with self._lock:
            if self._down and self.warn:
                log.warning("kvboost-rag: the shared KV tier at %s is back", self.where)
            self._down, self._delay = False, self.first
