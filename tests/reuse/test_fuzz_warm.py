"""Property-based fuzzing (hypothesis) of warm reports against the cache's own stats: for
any corpus (duplicates, long documents split into pieces, blank documents, which are
skipped, documents that cannot be a passage), any prefix (none, a prompt, chat messages)
and any batch size, ``warm_corpus`` either refuses clearly (a ``ValueError`` /
``TypeError`` from the package, nothing stored) or reports exactly what the memory tier
then holds: its passage entries are the report's units and bytes, its exact-prefix entries
the prompts' head; a second warm finds every unit cached; the first request laid out like
the prefix reads every passage and the head from the cache. Examples per property: 40
always; 2,000 under the ``slow`` marker."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import assert_clear, make_model, make_tokenizer, run_thorough
from hypothesis import event, given
from hypothesis import strategies as st

from kvboost_rag import KVBoost, KVBoostConfig, format_passages, warm_corpus
from kvboost_rag.warm import chat_prefix

BLOCK = 8
SENTENCES = st.sampled_from(
    [
        "The sky is blue.",
        "Grass is green.",
        "Snow is white. It is cold.",
        "word " * 12,  # no sentence end: split at words
        "x" * 40,  # no word boundary either: split between tokens
    ]
)
ODD = st.sampled_from(["", "  \n", "\t"]) | st.sampled_from([3, None, b"raw"])
DOCUMENTS = st.lists(SENTENCES, max_size=4) | st.lists(SENTENCES | ODD, min_size=1, max_size=3)
HEAD = st.text("abcdefgh :,", min_size=1, max_size=30).map(lambda t: t + ":\n")
PREFIXES = st.none() | HEAD | HEAD.map(chat_prefix) | st.just("Answer from these.\n")
BATCH = st.none() | st.integers(1, 4) | st.sampled_from([0, -1, 2.5, True])


@pytest.fixture(scope="module")
def model() -> Any:
    return make_model("llama")


def held(engine: KVBoost) -> tuple[list[Any], list[Any]]:
    """The memory tier's entries: (passage ones, exact prefix ones)."""
    entries = list(engine._store.memory._entries.values())
    return [e for e in entries if e.approximate], [e for e in entries if not e.approximate]


def request(engine: KVBoost, prefix: Any, docs: list[str]) -> Any:
    passages = format_passages(docs[::-1]) + "Which?"
    if isinstance(prefix, str):
        return engine.generate(prefix + passages, max_new_tokens=1)
    system = prefix[0]["content"]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": passages}]
    return engine.chat(messages, max_new_tokens=1)


@given(docs=DOCUMENTS, prefix=PREFIXES, batch=BATCH, fidelity=st.sampled_from(["fast", "balanced"]))
def test_warm_reports_what_the_cache_holds(model, docs, prefix, batch, fidelity) -> None:
    config = KVBoostConfig(fidelity=fidelity, block_tokens=BLOCK, max_passage_tokens=24)
    engine = KVBoost(model, make_tokenizer(), config)
    try:
        report = warm_corpus(engine, docs, prefix=prefix, batch_size=batch, progress=False)
    except (ValueError, TypeError) as error:
        assert_clear(error)
        event(f"refused: {type(error).__name__}")
        assert engine.stats().cache.entries == 0  # refused before anything was stored
        return
    event("warmed")
    assert batch is None or (isinstance(batch, int) and not isinstance(batch, bool) and batch > 0)
    pieces = {tuple(p) for p in engine._prompts.passages(docs)} if docs else set()
    passages, exact = held(engine)
    assert (report.documents, report.units, report.cached) == (len(docs), len(pieces), 0)
    assert report.new == report.units == len(passages)
    assert report.bytes == sum(e.nbytes for e in passages)
    assert report.tokens == sum(map(len, pieces))
    # Blank documents are skipped, each with a warning (issue 48); nothing is dropped.
    assert report.skipped == sum(isinstance(d, str) and not d.strip() for d in docs)
    assert (report.dropped, report.failed) == (0, ())
    head = engine._warmer._head(prefix)
    assert len(exact) == -(-len(head) // BLOCK)  # its full blocks and the partial one
    again = warm_corpus(engine, docs, prefix=prefix, batch_size=batch, progress=False)
    assert (again.units, again.cached, again.new, again.bytes) == (
        report.units,
        report.units,
        0,
        report.bytes,
    )
    assert tuple(map(len, held(engine))) == (len(passages), len(exact))
    if prefix is None or not docs:
        return
    first = request(engine, prefix, [d for d in docs if isinstance(d, str) and d.strip()])
    assert (first.passages_missed, first.passages_foreign) == (0, 0)
    if fidelity == "fast":  # "balanced" recomputes some passage tokens on purpose
        assert first.reused_tokens >= len(head) + report.tokens


@pytest.mark.slow
def test_every_property_holds_over_2000_examples() -> None:
    run_thorough(__file__, 1)
