"""Document-aware chunking: a prompt is fixed text and passages, each tokenized on its own.

Integrations and users wrap passages with ``passage(text)``; ``parse_segments`` finds the
markers and removes them, so markers never reach the model. Tokenizing every segment on
its own makes a passage's tokens identical in every prompt and in ``warm_corpus()``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvboost_rag.core.errors import KVBoostError

OPEN = "\u27e6kvboost:passage\u27e7"
CLOSE = "\u27e6/kvboost:passage\u27e7"
_MARKER = re.compile(re.escape(OPEN) + "|" + re.escape(CLOSE))
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


class MarkerError(KVBoostError, ValueError):
    """Passage markers that do not pair up (unclosed, nested or stray)."""


def passage(text: str) -> str:
    """Mark ``text`` as a passage whose KV may be cached and reused at any position."""
    if OPEN in text or CLOSE in text:
        raise MarkerError("passage text already contains a passage marker; pass plain text")
    return f"{OPEN}{text}{CLOSE}"


@dataclass(frozen=True)
class Segment:
    kind: Literal["text", "passage"]
    text: str


def parse_segments(prompt: str) -> list[Segment]:
    """Split ``prompt`` at passage markers. Raises ``MarkerError`` naming the offset."""
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
    if text:
        segments.append(Segment(kind, text))


def split_passage(text: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """Split a long passage into pieces of at most ~``max_tokens`` at sentence boundaries.

    Pieces concatenate back to ``text``. A single sentence longer than ``max_tokens`` stays
    whole rather than being cut mid-sentence.
    """
    if _count(tokenizer, text) <= max_tokens:
        return [text]
    pieces: list[str] = []
    current = ""
    for sentence in _sentences(text):
        if current and _count(tokenizer, current + sentence) > max_tokens:
            pieces.append(current)
            current = ""
        current += sentence
    if current:
        pieces.append(current)
    return pieces


def _sentences(text: str) -> list[str]:
    """Sentences with their trailing whitespace, so they join back to ``text``."""
    cuts = [m.end() for m in _SENTENCE_END.finditer(text)]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class TokenizedPrompt:
    """The model's input: token ids, and for each passage the span it occupies."""

    tokens: list[int]
    passages: list[tuple[int, int]]  # [start, end) of each passage piece, in order


def tokenize_segments(
    segments: Sequence[Segment], tokenizer: Any, prefix: Sequence[int], max_passage_tokens: int
) -> TokenizedPrompt:
    """Concatenate each segment's own tokenization after ``prefix`` (e.g. BOS)."""
    tokens = list(prefix)
    spans: list[tuple[int, int]] = []
    for segment in segments:
        for ids in _piece_ids(segment, tokenizer, max_passage_tokens):
            if segment.kind == "passage" and ids:
                spans.append((len(tokens), len(tokens) + len(ids)))
            tokens.extend(ids)
    return TokenizedPrompt(tokens, spans)


def _piece_ids(segment: Segment, tokenizer: Any, max_passage_tokens: int) -> list[list[int]]:
    """Token ids of a segment's pieces; tokenized once unless a passage needs splitting."""
    ids = list(tokenizer(segment.text, add_special_tokens=False)["input_ids"])
    if segment.kind == "text" or len(ids) <= max_passage_tokens:
        return [ids]
    pieces = split_passage(segment.text, tokenizer, max_passage_tokens)
    return [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces]
