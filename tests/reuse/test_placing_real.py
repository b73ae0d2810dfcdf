"""Passages found in prompts by the real tokenizers (SmolLM2, Qwen2.5, Gemma 3), whatever
text surrounds them: a known passage is found unmarked in any layout, and a run never
lends KV to a token it was not computed for (property runs over layouts that merge a
passage's edges with its neighbours: punctuation, spaces, no blank line, cut short)."""

from __future__ import annotations

import pytest
from families import family_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_rag.core.prompt.placing import HEAD_SLACK

FACTS = [
    "The Eiffel Tower was completed in 1889 for the World's Fair, and its iron lattice was "
    "assembled from 18,038 pieces held together by two and a half million rivets.",
    "Mount Fuji last erupted in 1707; its symmetrical cone rises 3,776 metres above the "
    "plain and is climbed by about two hundred thousand people every summer season.",
    "The Nile flows north through eleven countries, and its delta near Cairo fans out into "
    "the Mediterranean Sea across more than two hundred kilometres of coastline today.",
]
BEFORE = st.sampled_from(["", "\n", "\n\n", " ", ": ", "(", "- ", "Doc 1:", "x"])
AFTER = st.sampled_from(["", "\n", "\n\n", ".", ")", " and more", "?\n\n", ","])


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5", "gemma3"])
def engine(request):  # type: ignore[no-untyped-def]
    engine = family_engine(request.param, fidelity="balanced")
    engine.warm_passages(FACTS)
    return engine


@settings(max_examples=25)
@given(
    st.lists(st.tuples(BEFORE, st.integers(0, 2), AFTER, st.booleans()), min_size=1, max_size=4),
    st.sampled_from(["", "Context:\n", "Read this "]),
)
def test_a_found_run_holds_exactly_its_own_tokens(engine, parts, head: str) -> None:  # type: ignore[no-untyped-def]
    text = head
    for before, i, after, cut in parts:
        fact = FACTS[i][: len(FACTS[i]) // 2] if cut else FACTS[i]
        text += before + fact + after
    tokens = engine.tokenize(text + "\nQuestion: which?")
    placed, _ = engine._caches.place(engine._prompts.text(text + "\nQuestion: which?"))
    end = 0
    for p in placed:
        assert end <= p.start < p.end and p.first <= HEAD_SLACK
        assert tokens[p.start : p.end] == list(p.tokens[p.first : p.first + p.end - p.start])
        end = p.end
    whole = [f for _, i, _, cut in parts for f in [FACTS[i]] if not cut]
    found = {p.tokens for p in placed}
    for fact in whole:  # a passage held whole is found, its edges merged or not
        assert tuple(engine.tokenizer(fact, add_special_tokens=False)["input_ids"]) in found
