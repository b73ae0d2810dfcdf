"""Time to first token of a text stream, the one way the demo and the benchmarks time a
framework's streamed answer."""

from __future__ import annotations

import time
from collections.abc import Iterable


def first_token_ms(start: float, deltas: Iterable[str | None]) -> tuple[float, str]:
    """TTFT (ms since ``start``, a ``perf_counter`` reading) of a stream of text deltas,
    and the whole text; the stream is drained, so the model is idle afterwards."""
    ttft, parts = None, []
    for delta in deltas:
        if delta:
            ttft = ttft or (time.perf_counter() - start) * 1e3
            parts.append(delta)
    return ttft or (time.perf_counter() - start) * 1e3, "".join(parts)
