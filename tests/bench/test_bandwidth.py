"""The read bandwidth the decode study divides a step's bytes by
(``kvboost_rag/bench/common/bandwidth.py``)."""

from __future__ import annotations

import math

from kvboost_rag.bench.common.bandwidth import buffer_bytes, last_level_cache, read_bandwidth


def test_a_pass_over_a_small_buffer_gives_a_positive_finite_rate() -> None:
    rate = read_bandwidth(4 << 20, passes=2)
    assert rate > 0 and math.isfinite(rate)


def test_the_default_buffer_is_larger_than_the_caches() -> None:
    cache = last_level_cache()
    assert cache is None or cache > 0
    assert buffer_bytes() >= max(1 << 30, 4 * (cache or 0))
