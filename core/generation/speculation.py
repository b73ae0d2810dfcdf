"""Prompt-lookup speculation: draft the next tokens from the request's own text.

RAG answers copy from their passages (names, codes, whole sentences). When the last few
tokens of a request occurred before, in its prompt or its answer so far, the tokens that
followed them then are a good guess of what follows now. A decoding step feeds that draft
after the last token, the model scores every position in one forward (on a CPU a forward
of a few tokens costs about what one does: decoding reads every weight either way), and
the sampler keeps the longest prefix the model agrees with, plus the token after it
(``Sampler.verify``). Greedy output is token for token what plain decoding gives; sampled
output keeps its distribution. A draft is as long as the text that followed allows, up to
``max_draft``: verifying 9 tokens costs a row's forward about what 1 does, so a shorter
draft saves little and loses the tokens it leaves out. Shrinking the draft after a miss to
what was kept (and growing it back by 2 a step) measured slower on SmolLM2-135M fp32 (2-core
AVX-512 EPYC, 64-token answers over ~880-token RAG prompts, 3 prompts x 2): 19.5 against
13.2 ms a token after the first on extractive answers, 37.0 against 28.6 on open-ended
ones. ``hits`` follows how often a draft's first token is the one chosen next, and ``worth`` how
many tokens a draft would keep, by the n-gram it was matched on; both judge the drafts not
fed too (a batch feeds drafts only while they are worth their cost, ``drafting.py``), so a
request that stopped feeding them still sees when they would pay again.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAMS = (3, 2, 1)  # suffix lengths tried, longest first
HIT_MEMORY = 0.7  # weight of the earlier steps in ``hits`` (a miss halves it in two steps)


class PromptLookup:
    """Where each recent n-gram of a request's tokens last ended, to draft from."""

    def __init__(self, tokens: Sequence[int], max_draft: int) -> None:
        self.max_draft = max_draft
        self.hits = 1.0  # how often a draft's first token was chosen, recent steps most
        # By the n-gram length a draft was matched on: the tokens such a draft keeps (0
        # when its first is not chosen), recent drafts most; half a draft before any.
        self._worth = dict.fromkeys(NGRAMS, max(1.0, max_draft / 2))
        self.matched = 0  # the n-gram length of the latest draft (0: none)
        self._tokens: list[int] = []
        # n-gram -> where the token after its latest occurrence is
        self._last: dict[tuple[int, ...], int] = {}
        # drafts offered, fed or not, awaiting the tokens they guessed: (n, start, draft)
        self._open: list[tuple[int, int, list[int]]] = []
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` appended to the request, and judge the open drafts by them. An
        n-gram is indexed once a token follows it, so the request's own suffix is never its
        latest occurrence."""
        for token in tokens:
            self._tokens.append(token)
            end = len(self._tokens)
            for n in NGRAMS:
                if end - n - 1 >= 0:
                    self._last[tuple(self._tokens[end - n - 1 : end - 1])] = end - 1
        if self._open:
            self._judge_open()

    def draft(self, limit: int) -> list[int]:
        """Up to ``min(self.max_draft, limit)`` tokens that followed the longest suffix of
        the tokens before; empty when no suffix occurred before."""
        self.matched = 0
        count = min(self.max_draft, limit)
        if count <= 0:
            return []
        end = len(self._tokens)
        for n in NGRAMS:
            if end < n:
                continue
            start = self._last.get(tuple(self._tokens[end - n :]))
            if start is not None:
                draft = self._tokens[start : start + count]
                self.matched = n
                self._open.append((n, end, draft))
                return draft
        return []

    @property
    def worth(self) -> float:
        """About how many tokens the latest draft will keep: what drafts matched on as long
        an n-gram kept lately (0 where there was no draft)."""
        return self._worth[self.matched] if self.matched else 0.0

    def judged(self, proposed: int, chosen: int) -> None:
        """A draft starting with ``proposed`` was offered (fed or not) where ``chosen``
        was the token chosen."""
        self.hits = HIT_MEMORY * self.hits + (1 - HIT_MEMORY) * (proposed == chosen)

    def _judge_open(self) -> None:
        """Each open draft that the tokens since have ended (a token it guessed wrong, or
        all of it seen) counts its kept tokens, the agreeing prefix, toward its n-gram's
        ``worth``: a fed draft's is what the sampler kept, an unfed one's what it would have
        (for greedy decoding exactly so)."""
        still = []
        for n, start, draft in self._open:
            seen = self._tokens[start : start + len(draft)]
            kept = 0
            while kept < len(seen) and seen[kept] == draft[kept]:
                kept += 1
            if kept < len(seen) or len(seen) == len(draft):
                self._worth[n] = HIT_MEMORY * self._worth[n] + (1 - HIT_MEMORY) * kept
            else:
                still.append((n, start, draft))
        self._open = still
