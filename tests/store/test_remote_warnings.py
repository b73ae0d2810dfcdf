"""The shared tier's "unavailable" warning: one per fault, at the caller's line (issue 48
row 8: storage.md's two-engine example with Redis down warned twice, from tiers.py:52 and
tiers.py:72, lines of the package's own)."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

from conftest import make_model, make_tokenizer
from redis_server import free_port

from kvboost_rag import KVBoost, KVBoostConfig, format_passages, warm_corpus

UNITS = [
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "The Colosseum is in Rome and could hold about 50,000 people.",
]
HEAD = "Answer from these notes.\n\n"


def engine(url: str, folder: Path) -> KVBoost:
    config = KVBoostConfig(block_tokens=8, cache_dir=folder, remote_url=url)
    return KVBoost(make_model("llama"), make_tokenizer(), config)


def unavailable(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "shared KV tier" in str(w.message)]


def test_storage_guides_example_with_redis_down_warns_once_at_the_callers_line(
    tmp_path: Path,
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: connection refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning issued, none folded by the filter
        a = engine(url, tmp_path / "a")
        warm_corpus(a, UNITS, prefix=HEAD, progress=False)  # the fault's first call
        line = _this_line() - 1
        b = engine(url, tmp_path / "b")
        answer = b.generate(HEAD + format_passages(UNITS) + "Where?", max_new_tokens=4)
    found = unavailable(caught)
    assert len(found) == 1, [str(w.message) for w in found]
    assert "unavailable" in str(found[0].message)
    assert (found[0].filename, found[0].lineno) == (__file__, line)
    assert answer.passages_hit == 0  # b's disk folder is empty and Redis is down
    for one in (a, b):
        assert not one.stats().remote.available  # type: ignore[union-attr]


def test_a_later_call_of_the_same_engine_is_no_new_fault(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    one = engine(url, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one.generate(HEAD + format_passages(UNITS) + "Where?", max_new_tokens=2)
        line = _this_line() - 1
        one.warm_passages(UNITS[:1])
        one.flush()
    found = unavailable(caught)
    assert [(w.filename, w.lineno) for w in found] == [(__file__, line)]


def _this_line() -> int:
    """The caller's line number."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno
