"""Where a passage's own tokens sit in a prompt's tokens.

A prompt is tokenized as one text, as ``generate`` would see it; a passage's identity is
its text tokenized alone. The two agree inside the passage and may differ at its edges:
a BPE tokenizer merges the passage's last punctuation with the blank line after it
(Qwen's ``.ĊĊ``), and its first word with a space before it. So a passage is *placed* as
the longest run of prompt tokens equal to a run of its own tokens that starts within its
first ``HEAD_SLACK`` tokens. Only that run's stored KV is ever used: every reused position
holds the very token its KV was computed for, after the very tokens of the passage before
it. The edge tokens that merged are computed fresh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# At most this many of a passage's first tokens may be spelled otherwise in the prompt
# (merged with the text before it); past that its head is taken as absent and the passage
# is not placed, since its KV would carry text the prompt lacks.
HEAD_SLACK = 4


@dataclass(frozen=True)
class Placed:
    """A passage placed in a prompt: ``tokens[start - offset : end - offset]`` of its own
    tokens are the prompt's tokens ``[start, end)``."""

    tokens: tuple[int, ...]  # the passage's text tokenized alone: its identity in the cache
    start: int  # first prompt position holding one of its tokens unchanged
    end: int  # end of that run
    first: int  # which of its own tokens sits at ``start`` (those before merged or are cut)

    @property
    def offset(self) -> int:
        """Where its first token would sit: positions shift by ``offset`` from stored ones."""
        return self.start - self.first

    @property
    def whole(self) -> bool:
        """Whether every one of its tokens is in the prompt as it is."""
        return self.first == 0 and self.end - self.start == len(self.tokens)


def as_array(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def run_at(stream: np.ndarray, own: Sequence[int] | np.ndarray, at: int, first: int) -> int:
    """End of the run of ``stream`` from ``at`` equal to ``own`` from ``first``."""
    n = min(len(own) - first, len(stream) - at)
    if n <= 0:
        return at
    theirs = stream[at : at + n]
    mine = np.asarray(own[first : first + n], dtype=np.int64)
    differ = np.flatnonzero(theirs != mine)
    return at + (int(differ[0]) if len(differ) else n)


def place(
    stream: np.ndarray,
    own: Sequence[int],
    lo: int,
    hi: int,
    head_ok: Callable[[int, int], bool] | None = None,
) -> Placed | None:
    """The passage ``own`` placed in ``stream[lo:hi]``: the longest run found by starting
    at each of its first ``HEAD_SLACK + 1`` tokens (an earlier start wins a tie; a run
    missing no more than ``HEAD_SLACK`` tokens at either end is taken at once). A run
    starting at its token ``f > 0`` needs ``head_ok(position, f)``: that the prompt spells
    its first ``f`` tokens just before ``position`` (a caller that knows it, because the
    passage was marked there, passes None). None when no run is found."""
    best: Placed | None = None
    mine = np.asarray(own, dtype=np.int64)
    window = stream[lo:hi]
    for first in range(min(HEAD_SLACK + 1, len(own))):
        hits = np.flatnonzero(window == mine[first])
        for hit in hits[:64]:  # a token repeated more often than this is no anchor
            at = lo + int(hit)
            end = min(run_at(stream, mine, at, first), hi)
            if best is not None and end - at <= best.end - best.start:
                continue
            if first and head_ok is not None and not head_ok(at, first):
                continue
            best = Placed(tuple(own), at, end, first)
            if end - at >= len(own) - first - HEAD_SLACK:  # all but a merged edge
                return best
    return best
