import pytest

from kvboost_rag.core.prompt.chunker import (
    CLOSE,
    OPEN,
    MarkerError,
    Segment,
    parse_segments,
    passage,
    split_passage,
    tokenize_segments,
)


def test_markers_are_found_and_removed() -> None:
    prompt = "Context:\n" + passage("Alpha.") + "\n" + passage("Beta.") + "\nQ?"
    assert parse_segments(prompt) == [
        Segment("text", "Context:\n"),
        Segment("passage", "Alpha."),
        Segment("text", "\n"),
        Segment("passage", "Beta."),
        Segment("text", "\nQ?"),
    ]


def test_marker_text_never_reaches_the_tokens(tokenizer) -> None:
    prompt = "A " + passage("passage body") + " Q?"
    out = tokenize_segments(parse_segments(prompt), tokenizer, [], 512)
    decoded = tokenizer.decode(out.tokens)
    assert "kvboost" not in decoded and OPEN not in decoded and CLOSE not in decoded
    assert decoded == "A passage body Q?"
    (placed,) = out.passages
    assert tokenizer.decode(out.tokens[placed.start : placed.end]) == "passage body"
    assert placed.whole and list(placed.tokens) == out.tokens[placed.start : placed.end]


def test_passage_tokens_do_not_depend_on_neighbours(tokenizer) -> None:
    def span_tokens(prompt: str) -> list[int]:
        out = tokenize_segments(parse_segments(prompt), tokenizer, [], 512)
        return list(out.passages[0].tokens)

    assert span_tokens("x" + passage("same text")) == span_tokens("yy\n" + passage("same text"))


@pytest.mark.parametrize(
    "prompt, message",
    [
        (OPEN + "a", "unclosed passage marker at character 0"),
        ("ab" + OPEN + "x" + OPEN + "y" + CLOSE + CLOSE, "nested passage marker at character"),
        ("abc" + CLOSE, "stray passage close marker at character 3"),
    ],
)
def test_malformed_markers_name_the_position(prompt: str, message: str) -> None:
    with pytest.raises(MarkerError, match=message):
        parse_segments(prompt)


def test_passage_refuses_text_with_markers() -> None:
    with pytest.raises(MarkerError):
        passage("x" + OPEN)


def test_long_passages_split_at_sentences_and_rejoin(tokenizer) -> None:
    text = " ".join(f"Sentence number {i} ends here." for i in range(20))
    pieces = split_passage(text, tokenizer, max_tokens=80)
    assert len(pieces) > 1 and "".join(pieces) == text
    assert all(p.rstrip().endswith(".") for p in pieces)
    assert all(len(tokenizer(p.rstrip())["input_ids"]) <= 80 for p in pieces)
    out = tokenize_segments([Segment("passage", text)], tokenizer, [], 80)
    assert len(out.passages) == len(pieces)


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    "text, whole_words",
    [
        ("word " * 300, True),  # no sentence end: cut between words
        ("Short one. " + "wordy " * 80 + "end. Then more.", True),
        ("x" * 700, False),  # no space either: cut between tokens
        ("start " + "y" * 100 + " finish", False),  # one word longer than the limit
    ],
)
def test_text_without_sentence_ends_splits_at_words_then_tokens(
    tokenizer, text: str, whole_words: bool
) -> None:
    """A text without sentence ends was one piece of any length (a 2,000-token chunk
    from a splitter asked for 32)."""
    pieces = split_passage(text, tokenizer, max_tokens=32)
    assert len(pieces) > 1 and "".join(pieces) == text
    assert max(count(tokenizer, p) for p in pieces) <= 32
    if whole_words:
        assert all(p[-1].isspace() or p[-1] == "." for p in pieces[:-1])
    out = tokenize_segments([Segment("passage", text)], tokenizer, [], 32)
    assert all(len(p.tokens) <= 32 for p in out.passages)


def test_whitespace_at_a_passage_edge_is_layout() -> None:
    prompt = "Docs:" + passage("\n  Alpha.  \n") + "\n\n" + passage("Beta.") + " Q?"
    assert parse_segments(prompt) == [
        Segment("text", "Docs:\n  "),
        Segment("passage", "Alpha."),
        Segment("text", "  \n\n\n"),
        Segment("passage", "Beta."),
        Segment("text", " Q?"),
    ]


def test_a_whitespace_only_passage_is_text() -> None:
    assert parse_segments("a" + passage(" \n ") + "b") == [Segment("text", "a \n b")]


def test_split_pieces_keep_no_edge_whitespace(tokenizer) -> None:
    text = " ".join(f"Sentence number {i} ends here." for i in range(20))
    out = tokenize_segments([Segment("passage", text)], tokenizer, [], 80)
    assert tokenizer.decode(out.tokens) == text
    pieces = [tokenizer.decode(p.tokens) for p in out.passages]
    assert all(p == p.strip() and p.endswith(".") for p in pieces)


def test_a_text_prefix_is_tokenized_as_a_prompt_holds_it(tokenizer) -> None:
    """SmolLM2 spells a blank line as one token at the end of a text, as two before a word:
    the prefix passages are warmed after is the prompt's own."""
    from kvboost_rag.core.prompt.prompts import PromptEncoder, before_passages

    encoder = PromptEncoder(tokenizer, context_window=4096, max_passage_tokens=512)
    head = "Answer from these notes.\n\n"
    assert tokenizer(head)["input_ids"][-1:] != tokenizer(head + "The")["input_ids"][-3:-2]
    prompt = encoder.text(head + passage("The Eiffel Tower is in Paris.") + "\n\nWhere?")
    assert encoder.prefix(head) == before_passages(prompt)
