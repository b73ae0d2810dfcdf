"""Property-based input tests (hypothesis): for any text, the marker parser, the chunker
and the prompt encoder either raise a specific error naming the problem, or produce
segments / token spans that cover exactly the marked text, with no marker in the model
input. Examples per property: 40 always; 2,000 in the ``slow`` run (``pytest -m slow``),
which runs this file again under HYPOTHESIS_PROFILE=thorough."""

import pytest
from conftest import run_thorough
from hypothesis import assume, example, given
from hypothesis import strategies as st

from kvboost_rag.core.errors import KVBoostError
from kvboost_rag.core.model.loading import resolve_model_path
from kvboost_rag.core.prompt.chunker import (
    CLOSE,
    OPEN,
    MarkerError,
    edges,
    parse_segments,
    passage,
    split_passage,
)

# Any unicode: emoji, RTL, combining marks, NUL and control characters, lone surrogates
# excluded (a Python str that cannot be UTF-8 encoded is no text a user can send).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=200)
FRAGMENTS = st.sampled_from([OPEN, CLOSE, OPEN[:5], CLOSE[3:], "\u27e6", "\u27e7", "kvboost:"])
PIECES = st.lists(st.one_of(TEXT, FRAGMENTS), max_size=12)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


def strip_markers(text: str) -> str:
    return text.replace(OPEN, "").replace(CLOSE, "")


@given(PIECES)
def test_any_text_parses_to_the_unmarked_text_or_a_marker_error(pieces: list[str]) -> None:
    prompt = "".join(pieces)
    try:
        segments = parse_segments(prompt)
    except MarkerError as error:
        assert "marker at character" in str(error)
        return
    assert "".join(s.text for s in segments) == strip_markers(prompt)
    assert all(OPEN not in s.text and CLOSE not in s.text for s in segments)
    assert all(s.text for s in segments)  # no empty segment
    kinds = [s.kind for s in segments]
    assert all(a != "text" or b != "text" for a, b in zip(kinds, kinds[1:]))  # text joined


@given(st.lists(st.tuples(st.booleans(), TEXT), max_size=10))
def test_marked_passages_come_back_as_their_stripped_text(parts: list[tuple[bool, str]]) -> None:
    assume(all(OPEN not in t and CLOSE not in t for _, t in parts))
    prompt = "".join(passage(t) if marked else t for marked, t in parts)
    found = [s.text for s in parse_segments(prompt) if s.kind == "passage"]
    want = [edges(t)[1] for marked, t in parts if marked and edges(t)[1]]
    assert found == want


@given(TEXT, st.sampled_from([OPEN, CLOSE]), TEXT)
def test_passage_text_holding_a_marker_is_refused(head: str, marker: str, tail: str) -> None:
    with pytest.raises(MarkerError, match="already contains a passage marker"):
        passage(head + marker + tail)


@given(st.text(max_size=2000), st.integers(1, 64))
def test_split_pieces_join_back_to_the_passage(tokenizer, text: str, max_tokens: int) -> None:
    pieces = split_passage(text, tokenizer, max_tokens)
    assert "".join(pieces) == text
    assert all(pieces) or pieces == [""]


# Text without a sentence end, or without whitespace either (one long "word"), of any
# script: emoji, CJK, combining marks, controls.
NO_END = st.characters(exclude_categories=("Cs",), exclude_characters=".!?")
WORDLESS = st.text(NO_END.filter(lambda c: not c.isspace()), min_size=1, max_size=400)
SENTENCELESS = st.lists(WORDLESS, min_size=1, max_size=40).map(" ".join)


@given(st.one_of(WORDLESS, SENTENCELESS, TEXT), st.integers(4, 64))
@example("\U00040000" * 4, 4)  # 12 byte tokens whose offsets cover 3 characters: cut apart
def test_every_split_piece_fits_whatever_boundaries_the_text_has(
    tokenizer, text: str, max_tokens: int
) -> None:
    """Text without sentence ends was one piece of any length; without spaces too."""
    pieces = split_passage(text, tokenizer, max_tokens)
    assert "".join(pieces) == text
    for piece in pieces:
        # Only one character the tokenizer spells in more tokens than the limit is longer.
        assert count(tokenizer, piece) <= max_tokens or len(piece) == 1, (piece, max_tokens)
    spaced = all(c == " " or not c.isspace() for c in text) and not set(text) & set(".!?")
    if spaced and all(count(tokenizer, w + " ") <= max_tokens for w in text.split(" ")):
        assert all(p.endswith(" ") for p in pieces[:-1])  # cut between words, not inside


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@given(st.lists(TEXT, min_size=1, max_size=6), TEXT)
def test_prompt_tokens_are_the_plain_texts_and_placed_passages_hold_their_own(
    tokenizer, docs, question
) -> None:
    """The model reads the tokenizer's tokens for the plain text (what ``generate`` reads);
    every placed passage's run is its own tokens, unchanged, starting within its first
    ``HEAD_SLACK`` tokens; passages are placed in order, never overlapping."""
    from kvboost_rag.core.prompt.chunker import PASSAGE_SEPARATOR
    from kvboost_rag.core.prompt.placing import HEAD_SLACK
    from kvboost_rag.core.prompt.prompts import PromptEncoder

    assume(all(OPEN not in t and CLOSE not in t for t in [*docs, question]))
    encoder = PromptEncoder(tokenizer, context_window=8192, max_passage_tokens=8192)
    try:
        prompt = encoder.text(question, docs)
    except KVBoostError as error:  # empty prompt and no passage, or over the window
        assert str(error)
        return
    plain = "".join(d + PASSAGE_SEPARATOR for d in docs) + question
    assert prompt.tokens == tokenizer(plain)["input_ids"]
    cores = [edges(d)[1] for d in docs if edges(d)[1]]
    own = [tuple(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in cores]
    rest = iter(own)
    assert all(any(p.tokens == o for o in rest) for p in prompt.passages)  # in order
    end = 0
    for p in prompt.passages:
        assert end <= p.start < p.end and p.first <= HEAD_SLACK
        assert (
            tuple(prompt.tokens[p.start : p.end]) == p.tokens[p.first : p.first + p.end - p.start]
        )
        end = p.end


@pytest.mark.slow
def test_every_property_holds_over_2000_examples() -> None:
    run_thorough(__file__, 6)
