"""Passages in a prompt that marks none and holds none the engine knows: its paragraphs.

Frameworks join retrieved documents with a blank line (LangChain's stuff chain, LlamaIndex's
context string), so in a prompt without markers each long paragraph is taken for a passage
seen for the first time: the engine encodes it after the answer, indexes it, and the next
prompt that holds it reuses it wherever it lands. A paragraph is the tokens between two
blank lines; the tokens that hold a blank line are layout, never in a passage. So are a
chat template's special tokens (``<|im_end|>``, ``<|im_start|>``): a paragraph never spans
two turns. One that did (a tool-calling template's instructions, the turn's end and the
next turn's question, with no blank line between) was stored whole, and a later prompt
holding the same instructions before another question reused its head approximately,
where that question's answer changed (the function-calling leaderboard's multiple_46).
"""

from __future__ import annotations

from typing import Any

# A paragraph shorter than this is not worth a passage: it is what the plan prefills
# plainly anyway (policy.SHORT_PASSAGE), so it is never encoded alone.
MIN_PARAGRAPH = 64


class Breaks:
    """Which token ids hold a blank line or are special (a template's turn markers), or
    start or end with a newline (two of which in a row make one), decoded once per id as
    prompts bring them. Thread-safe (a lost race decodes an id twice)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._known: dict[int, tuple[bool, bool, bool]] = {
            token: (True, False, False) for token in special_ids(tokenizer)
        }

    def kind(self, token: int) -> tuple[bool, bool, bool]:
        """(breaks a paragraph as a blank line does, starts with a newline, ends with one)."""
        known = self._known.get(token)
        if known is None:
            text = self._tokenizer.decode([token]).replace("\r", "").replace(" ", "")
            known = self._known[token] = (
                "\n\n" in text,
                text.startswith("\n"),
                text.endswith("\n"),
            )
        return known


def special_ids(tokenizer: Any) -> set[int]:
    """The ids of ``tokenizer``'s special tokens: its named ones and every added token
    marked special (Qwen's ``<|im_start|>`` and ``<|im_end|>``)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(
        token for token, added_token in added.items() if getattr(added_token, "special", False)
    )
    return ids


def paragraphs(
    tokens: list[int], breaks: Breaks, least: int = MIN_PARAGRAPH
) -> list[tuple[int, int]]:
    """The ``[start, end)`` of every run of at least ``least`` tokens between blank lines."""
    found, start = [], 0
    ends_line = False
    for i, token in enumerate(tokens):
        blank, starts, ends = breaks.kind(token)
        if blank or (starts and ends_line):
            cut = i if blank else i - 1  # a newline token ending the last line is layout
            if cut - start >= least:
                found.append((start, cut))
            start = i + 1
        ends_line = ends
    if len(tokens) - start >= least:
        found.append((start, len(tokens)))
    return found
