"""The passage index: known passages found in any prompt's tokens without markers, and never
the wrong KV. Property runs (hypothesis) over corpora built to confuse it: near-duplicate
passages, a passage that is a prefix of another, one repeated in a prompt, passages cut at
the prompt's end or missing their head. Examples per property: hypothesis' default (100);
the ``slow`` run repeats them at 2,000."""

from __future__ import annotations

import time

import pytest
from conftest import run_thorough
from hypothesis import given
from hypothesis import strategies as st

from kvboost_rag.core.prompt.placing import HEAD_SLACK, Placed
from kvboost_rag.core.reuse.index import WINDOW, PassageIndex

# Passages draw from a small alphabet so that they share runs; separators from another,
# so a passage's run never spills into them.
TOKEN = st.integers(1, 6)
PASSAGE = st.lists(TOKEN, min_size=WINDOW + HEAD_SLACK, max_size=60)
SEPARATOR = st.lists(st.integers(100, 120), min_size=0, max_size=5)


def variants(draw, base: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """``base`` as a prompt may hold it: whole, one token changed, its tail or head cut."""
    kind = draw(st.sampled_from(["whole", "changed", "tail cut", "head cut", "head cut"]))
    if kind == "changed":
        i = draw(st.integers(0, len(base) - 1))
        return [*base[:i], 7, *base[i + 1 :]]
    if kind == "tail cut":
        return base[: draw(st.integers(1, len(base)))]
    if kind == "head cut":  # mostly a few tokens: the cuts an anchor window still sees
        near = st.integers(1, HEAD_SLACK + 2)
        return base[draw(st.one_of(near, near, st.integers(1, len(base) - 1))) :]
    return base


@st.composite
def corpus_and_prompt(draw):  # type: ignore[no-untyped-def]
    bases = draw(st.lists(PASSAGE, min_size=1, max_size=4))
    corpus = list(bases)
    for base in bases:  # near-duplicates and prefixes of each other in the index itself
        if draw(st.booleans()):
            corpus.append(variants(draw, base))
    picks = draw(st.lists(st.integers(0, len(bases) - 1), min_size=1, max_size=5))
    prompt, whole = [], []
    for i in picks:  # a pick may repeat: the same passage twice in one prompt
        prompt += draw(SEPARATOR)
        held = variants(draw, bases[i])
        if held == bases[i]:
            whole.append((len(prompt), len(prompt) + len(held)))
        prompt += held
    prompt += draw(SEPARATOR)
    return corpus, prompt, whole


def check_placed(prompt: list[int], placed: list[Placed], index: PassageIndex) -> None:
    """Every reused position holds the very token its KV was computed for, after the very
    tokens of the passage before it (no head missing); runs in order, apart."""
    end = 0
    for p in placed:
        assert p.tokens in index
        assert end <= p.start < p.end <= len(prompt)
        assert prompt[p.start : p.end] == list(p.tokens[p.first : p.first + p.end - p.start])
        assert p.first == 0  # without a head check, a run must start at the passage's start
        end = p.end


@given(corpus_and_prompt())
def test_found_passages_hold_exactly_their_tokens(case) -> None:  # type: ignore[no-untyped-def]
    corpus, prompt, _ = case
    index = PassageIndex()
    for tokens in corpus:
        index.add(tokens)
    check_placed(prompt, index.find(prompt), index)


@given(corpus_and_prompt())
def test_every_whole_passage_in_a_prompt_is_found(case) -> None:  # type: ignore[no-untyped-def]
    corpus, prompt, whole = case
    index = PassageIndex()
    for tokens in corpus:
        index.add(tokens)
    placed = index.find(prompt)
    covered = {i for p in placed for i in range(p.start, p.end)}
    for start, end in whole:  # a passage held whole is reused whole (by it or its equal)
        assert set(range(start, end)) <= covered


@given(corpus_and_prompt(), st.integers(1, HEAD_SLACK))
def test_a_merged_head_needs_the_head_check(case, merged: int) -> None:  # type: ignore[no-untyped-def]
    """A run that starts past a passage's first token is taken only where the head check
    says the prompt spells the missing tokens, and with at most HEAD_SLACK missing."""
    corpus, prompt, _ = case
    index = PassageIndex()
    for tokens in corpus:
        index.add(tokens)
    asked: list[int] = []

    def head_ok(before, missing, own) -> bool:  # type: ignore[no-untyped-def]
        asked.append(missing)
        return missing <= merged

    for p in index.find(prompt, head_ok=head_ok):
        assert p.first <= merged and prompt[p.start : p.end] == list(
            p.tokens[p.first : p.first + p.end - p.start]
        )
    assert all(1 <= m <= HEAD_SLACK for m in asked)


def test_taken_spans_are_left_alone_and_short_passages_are_not_indexed() -> None:
    index = PassageIndex()
    passage = list(range(10, 10 + WINDOW + HEAD_SLACK))
    assert not index.add(passage[:-1]) and len(index) == 0
    assert index.add(passage)
    prompt = [1, 2, *passage, 3, *passage]
    (first, second) = index.find(prompt)
    assert (first.start, second.start) == (2, 3 + len(passage))
    assert [p.start for p in index.find(prompt, taken=[first])] == [second.start]


def test_the_index_keeps_its_bound_least_recently_found_first() -> None:
    index = PassageIndex(max_passages=2)
    a, b, c = ([k] * 2 + list(range(20 * k, 20 * k + 30)) for k in (1, 2, 3))
    index.add(a)
    index.add(b)
    index.find([0, *a, 0])  # a is found: b is now the oldest
    index.add(c)
    assert a in index and c in index and b not in index
    assert index.find([0, *b, 0]) == []


@pytest.mark.slow
def test_every_index_property_holds_over_2000_examples() -> None:
    run_thorough(__file__, 6)


def test_a_later_process_finds_what_an_earlier_one_stored_on_disk(tmp_path) -> None:
    """The catalogue next to the disk tier: passages an index learnt are found by a new
    index over the same folder; a damaged record is skipped, the rest still read."""
    from kvboost_rag.core.store.catalogue import Catalogue

    catalogue = Catalogue(tmp_path)
    first = PassageIndex(known=catalogue.read_new, record=catalogue.add)
    a, b = (list(range(k, k + 30)) for k in (100, 200))
    first.add(a)
    first.add(b)
    first.add(a)  # known: not recorded again
    with open(catalogue.path, "r+b") as file:  # damage the first record's tokens
        file.seek(20)
        file.write(b"\xff")
    again = Catalogue(tmp_path)
    later = PassageIndex(known=again.read_new, record=again.add)
    assert b in later and a not in later and len(later) == 1
    assert [p.tokens for p in later.find([1, *b, 2])] == [tuple(b)]


def test_an_index_learns_what_other_processes_store_when_its_refresh_is_due(tmp_path) -> None:
    """A server's index keeps reading the catalogues: a passage another process stores
    after the index's first lookup is found by a lookup once ``refresh_seconds`` passed,
    not before (a lookup reads the catalogues at most that often)."""
    from kvboost_rag.core.store.catalogue import Catalogue

    other = Catalogue(tmp_path)
    a, b = (list(range(k, k + 30)) for k in (100, 200))
    other.add(a)
    mine = Catalogue(tmp_path)
    index = PassageIndex(known=mine.read_new, record=mine.add, refresh_seconds=0.2)
    assert [p.tokens for p in index.find([1, *a, 2])] == [tuple(a)]
    other.add(b)
    assert index.find([1, *b, 2]) == []  # read 0 s ago: not due
    time.sleep(0.25)
    assert [p.tokens for p in index.find([1, *b, 2])] == [tuple(b)]
    index.add(b)
    assert Catalogue(tmp_path).read_new() == [tuple(a), tuple(b)]  # learnt, not recorded again
