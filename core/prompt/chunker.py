"""Document-aware chunking: a prompt is fixed text and passages; the model reads the plain text.

Integrations and users wrap passages with ``passage(text)``; ``parse_segments`` finds the
markers and removes them, so markers never reach the model. The prompt's tokens are the
tokenizer's tokens for the plain text, exactly what ``generate`` is given; the markers
only say where passages are. A passage's identity is its text tokenized alone, the same in
every prompt and in ``warm_corpus()``, and it is placed in the prompt's tokens by content
(``placing``): where the tokenizer merged its edges with the text around it, those few
tokens are the prompt's own and computed fresh.

Whitespace at a passage's edges, separators, numbering and headers around it are layout,
not part of its identity, so the same passage is found whatever surrounds it. This module
is the one place that lays out a list of passages (``format_passages``) and the one place
that knows what a marked passage is.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvboost_rag.core.errors import KVBoostError
from kvboost_rag.core.prompt.placing import Placed, as_array, place

OPEN = "\u27e6kvboost:passage\u27e7"
CLOSE = "\u27e6/kvboost:passage\u27e7"
_MARKER = re.compile(re.escape(OPEN) + "|" + re.escape(CLOSE))
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")
_WORD_START = re.compile(r"(?<=\s)(?=\S)")
_EDGES = re.compile(r"^(\s*)(.*?)(\s*)$", re.DOTALL)

# What ``format_passages`` puts after each passage, outside its marker: layout, not content.
PASSAGE_SEPARATOR = "\n\n"


class MarkerError(KVBoostError, ValueError):
    """Passage markers that do not pair up (unclosed, nested or stray)."""


def passage(text: str) -> str:
    """Mark ``text`` as a passage whose KV may be cached and reused at any position."""
    if OPEN in text or CLOSE in text:
        raise MarkerError("passage text already contains a passage marker; pass plain text")
    return f"{OPEN}{text}{CLOSE}"


def format_passages(texts: Sequence[str]) -> str:
    """Passages marked for reuse, each followed by a blank line: how the engine's
    ``passages=``, the integrations' document helpers and the benchmarks lay out a list of
    retrieved passages. Any other layout finds the same cached passages."""
    return "".join(passage(text) + PASSAGE_SEPARATOR for text in texts)


def edges(text: str) -> tuple[str, str, str]:
    """``(leading whitespace, content, trailing whitespace)`` of a passage."""
    match = _EDGES.match(text)
    assert match is not None  # the pattern matches any string
    return match.group(1), match.group(2), match.group(3)


@dataclass(frozen=True)
class Segment:
    kind: Literal["text", "passage"]
    text: str


def parse_segments(prompt: str) -> list[Segment]:
    """Split ``prompt`` at passage markers. Whitespace at a passage's edges goes to the text
    around it; neighbouring text joins into one segment. Raises ``MarkerError`` naming the
    offset of an unclosed, nested or stray marker."""
    segments: list[Segment] = []
    cursor, open_at = 0, -1
    for m in _MARKER.finditer(prompt):
        if m.group() == OPEN:
            if open_at >= 0:
                raise MarkerError(
                    f"nested passage marker at character {m.start()} "
                    f"(the passage opened at {open_at} is not closed)"
                )
            _append(segments, "text", prompt[cursor : m.start()])
            open_at = m.start()
        else:
            if open_at < 0:
                raise MarkerError(f"stray passage close marker at character {m.start()}")
            _append(segments, "passage", prompt[cursor : m.start()])
            open_at = -1
        cursor = m.end()
    if open_at >= 0:
        raise MarkerError(f"unclosed passage marker at character {open_at}")
    _append(segments, "text", prompt[cursor:])
    return segments


def _append(segments: list[Segment], kind: Literal["text", "passage"], text: str) -> None:
    if kind == "passage":
        lead, text, trail = edges(text)
        _append(segments, "text", lead)
        if text:
            segments.append(Segment("passage", text))
        _append(segments, "text", trail)
    elif text and segments and segments[-1].kind == "text":
        segments[-1] = Segment("text", segments[-1].text + text)
    elif text:
        segments.append(Segment(kind, text))


def split_passage(text: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """Split a long passage into pieces of at most ``max_tokens`` tokens: at sentence
    boundaries; a sentence longer than that at word boundaries; a word longer than that
    between its tokens (then characters). Pieces concatenate back to ``text``. Only a piece
    of one character the tokenizer spells in more than ``max_tokens`` tokens is longer.
    """
    if _count(tokenizer, text) <= max_tokens:
        return [text]
    return _packed(text, tokenizer, max_tokens, 0)


def _packed(text: str, tokenizer: Any, max_tokens: int, level: int) -> list[str]:
    """``text``'s units at ``level`` (sentences, words, tokens, characters) joined greedily
    into pieces of at most ``max_tokens``; a unit longer than that alone is split at the
    next level."""
    pieces: list[str] = []
    current = ""
    for unit in _UNITS[level](text, tokenizer):
        if current and _count(tokenizer, current + unit) > max_tokens:
            pieces.append(current)
            current = ""
        if not current and level + 1 < len(_UNITS) and _count(tokenizer, unit) > max_tokens:
            *done, current = _packed(unit, tokenizer, max_tokens, level + 1)
            pieces += done
            continue
        current += unit
    if current:
        pieces.append(current)
    return pieces


def _sentences(text: str, tokenizer: Any = None) -> list[str]:
    """Sentences with their trailing whitespace, so they join back to ``text``."""
    return _cut(text, [m.end() for m in _SENTENCE_END.finditer(text)])


def _words(text: str, tokenizer: Any = None) -> list[str]:
    """Words with their trailing whitespace."""
    return _cut(text, [m.start() for m in _WORD_START.finditer(text)])


def _tokens(text: str, tokenizer: Any) -> list[str]:
    """The text of each token (characters where the tokenizer gives no offsets)."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [start for start, _ in offsets["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError, ValueError):  # a slow tokenizer
        starts = list(range(len(text)))
    return _cut(text, starts)


def _characters(text: str, tokenizer: Any = None) -> list[str]:
    """Where a tokenizer's offsets leave a token's text longer than the limit (byte-level
    tokens of rare characters can map several characters to too few offsets)."""
    return list(text)


def _cut(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at the given positions (in any order, repeats and ends ignored)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


_UNITS = (_sentences, _words, _tokens, _characters)


def _count(tokenizer: Any, text: str) -> int:
    return len(_ids(tokenizer, text))


@dataclass(frozen=True)
class TokenizedPrompt:
    """The model's input: the tokenizer's tokens for the prompt's plain text (markers
    removed), and each passage placed in them (in order)."""

    tokens: list[int]
    passages: list[Placed]


def tokenize_segments(
    segments: Sequence[Segment], tokenizer: Any, prefix: Sequence[int], max_passage_tokens: int
) -> TokenizedPrompt:
    """The segments' plain text tokenized whole after ``prefix`` (e.g. BOS), as
    ``generate`` sees it, with each marked passage (piece) placed where its text is."""
    pieces = _pieces(segments, tokenizer, max_passage_tokens)
    text = "".join(piece for _, piece, _ in pieces)
    ids, offsets = _with_offsets(tokenizer, text)
    tokens = list(prefix) + ids
    stream = as_array(tokens)
    placed: list[Placed] = []
    cursor, after = 0, len(prefix)  # passages are placed in order, each after the one before
    for kind, piece, own in pieces:
        begin, cursor = cursor, cursor + len(piece)
        if kind != "passage" or not own:
            continue
        if offsets is None:  # a tokenizer without offsets: searched from the last one on
            lo, hi = after, len(tokens)
        else:
            lo = max(len(prefix) + bisect.bisect_right(offsets[1], begin), after)
            hi = len(prefix) + bisect.bisect_left(offsets[0], cursor)
        spot = place(stream, own, lo, hi)
        if spot is not None:
            placed.append(spot)
            after = spot.end
    return TokenizedPrompt(tokens, placed)


def passage_ids(texts: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Each passage's identity: its text tokenized alone (one tokenizer call for all)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def passage_texts(
    segments: Sequence[Segment], tokenizer: Any, max_passage_tokens: int
) -> list[str]:
    """The text of every passage piece of ``segments`` (long passages split)."""
    return [
        t for kind, t, _ in _pieces(segments, tokenizer, max_passage_tokens) if kind == "passage"
    ]


def _with_offsets(
    tokenizer: Any, text: str
) -> tuple[list[int], tuple[list[int], list[int]] | None]:
    """Token ids of ``text`` and their character starts and ends (None without offsets)."""
    if not text:
        return [], ([], [])
    try:
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):  # a slow tokenizer
        return _ids(tokenizer, text), None
    spans = out["offset_mapping"]
    return list(out["input_ids"]), ([s for s, _ in spans], [e for _, e in spans])


def _pieces(
    segments: Sequence[Segment], tokenizer: Any, max_passage_tokens: int
) -> list[tuple[str, str, list[int]]]:
    """``(kind, text, own token ids)`` of every piece (ids for passages only): a long
    passage becomes sentence-aligned pieces, the whitespace between them fixed text, as if
    each piece had been marked alone."""
    passages = [s.text for s in segments if s.kind == "passage"]
    owns = iter(passage_ids(passages, tokenizer))
    out: list[tuple[str, str, list[int]]] = []
    for segment in segments:
        if segment.kind == "text":
            out.append(("text", segment.text, []))
            continue
        own = next(owns)
        if len(own) <= max_passage_tokens:
            out.append(("passage", segment.text, own))
            continue
        for piece in split_passage(segment.text, tokenizer, max_passage_tokens):
            lead, core, trail = edges(piece)
            for kind, text in (("text", lead), ("passage", core), ("text", trail)):
                if text:
                    ids = _ids(tokenizer, text) if kind == "passage" else []
                    out.append((kind, text, ids))
    return out


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
