"""Where a prompt's passages read each other: text two passages share.

A passage encoded on its own misses what it would have read in the passages before it. On
real models that is concentrated where passages share text: attention heads that find an
earlier occurrence of the current words (copy and induction heads) link a passage's
sentence to its look-alike in another passage, and the question reads the answer through
those links. Measured on Qwen2.5-Coder-0.5B (docs/bench/fidelity.md): with a look-alike fact
sentence in every passage, the tokens whose KV moves most from the cached values are those
sentences and each passage's first words, and recomputing exactly them kept every answer
where no repair kept 3 in 8.

Everything here is a pure function of token ids: no model runs to find them.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any

# Tokens in a row that make a passage's text "shared" when another passage holds the same
# run: 4 tokens is a phrase (one or two words are everywhere).
SHARED_RUN = 4
# What ends a sentence, as the end of a token's text.
SENTENCE_ENDS = (".", "!", "?", ":", ";", "\n")


class SentenceEnds:
    """Which token ids end a sentence (their text ends with one of ``SENTENCE_ENDS``,
    trailing spaces aside), decoded once per id as prompts bring them: a vocabulary of 150k
    tokens took ~2 s to decode whole, a prompt's few hundred distinct ids take milliseconds.
    Thread-safe (a lost race decodes an id twice)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._known: dict[int, bool] = {}

    def __contains__(self, token: object) -> bool:
        if not isinstance(token, int):
            return False
        known = self._known.get(token)
        if known is None:
            text = self._tokenizer.decode([token])
            known = self._known[token] = text.rstrip(" ").endswith(SENTENCE_ENDS)
        return known


def shared_sentences(
    tokens: Sequence[int],
    spans: Sequence[tuple[int, int]],
    ends: Container[int],
    run: int = SHARED_RUN,
) -> list[tuple[int, int]]:
    """The sentences ``[start, end)`` of the passages at ``spans`` that hold ``run`` tokens
    in a row occurring in another of those passages too."""
    owners: dict[tuple[int, ...], set[int]] = {}
    for j, (start, end) in enumerate(spans):
        for i in range(start, end - run + 1):
            owners.setdefault(tuple(tokens[i : i + run]), set()).add(j)
    found: list[tuple[int, int]] = []
    for start, end in spans:
        shared = [
            i for i in range(start, end - run + 1) if len(owners[tuple(tokens[i : i + run])]) > 1
        ]
        found.extend(s for s in sentences(tokens, start, end, ends) if _holds(s, shared, run))
    return found


def sentences(
    tokens: Sequence[int], start: int, end: int, ends: Container[int]
) -> list[tuple[int, int]]:
    """``[start, end)`` cut after each token that ends a sentence."""
    out, first = [], start
    for i in range(start, end):
        if tokens[i] in ends:
            out.append((first, i + 1))
            first = i + 1
    if first < end:
        out.append((first, end))
    return out


def _holds(sentence: tuple[int, int], starts: Iterable[int], run: int) -> bool:
    """Whether a shared run starting at one of ``starts`` overlaps ``sentence``."""
    a, b = sentence
    return any(i < b and i + run > a for i in starts)
