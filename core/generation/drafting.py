"""Which drafts a decoding step feeds (``speculation.py`` proposes them).

A lone row feeds its draft: on a CPU a few more tokens cost a forward over dense weights
little. Two exceptions feed it only while the tokens it should keep (``PromptLookup.worth``,
by the n-gram it was matched on, judged on drafts fed or not) pay for the verify:

- the row could take the compiled step instead (``compiled.py``), since a draft's verify
  runs eagerly: while ``worth + 1`` is at least the eager verify's time over the compiled
  step's, both measured on the model's recent steps of one row (starting from the
  warm-up's check, ``CompiledStep.ms``);
- the weights are quantized (``model/quantized.py``), whose kernels' time grows with the
  rows: while ``worth + 1`` is at least the draft's rows' time over one row's, as the
  products were measured at load (Qwen2.5-Coder-1.5B with int8 weights decoded open-ended
  answers at 327 ms a token feeding every draft, against generate's 216).

Several rows feed their drafts while they hit often enough to pay for widening every row's
forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvboost_rag.core.generation.compiled import CompiledStep
from kvboost_rag.core.generation.request import Request

# Drafted tokens per row when several rows decode at once: each is one more query row in
# every row's forward (rows are padded to the longest draft), so a short draft pays where
# a request's own 8 would not. 8 concurrent 256-token answers (SmolLM2-135M fp32, 2-core
# AVX2 EPYC, docs/bench/decode-concurrent-float32.txt) measured 45.4 against 37.1 tokens/s
# extractive and 41.8 against 33.5 open-ended with 2 drafted and none. At 64 tokens, where
# the 8 prefills take most of the time, 2 was below none open-ended (18.5 against 22.8);
# one step of 8 rows over ~900 keys took ~170 / ~200 / ~250 ms feeding 1 / 2 / 3 tokens a
# row, and in one run of every choice, twice, 1 drafted measured 12.7-13.2 tokens/s
# open-ended against 12.6-12.8 for none and 11.7-12.4 for 2 (extractive 14.3 twice for 1,
# 13.6-15.0 for none, 12.6-14.8 for 2; greedy answers identical throughout). Kept at
# Qwen2.5-Coder-1.5B (bf16, 2-core Xeon): a step of 8 rows fed 2 / 3 tokens a row took 1.28 /
# 1.48x one fed 1 (``scripts/step_constants.py``, records docs/bench/constants-*), and 8
# answers at once, 3 rounds of each (``scripts/eight_rows.py``) gave 25.2 / 22.3 tokens/s
# (extractive / open-ended) with 1 and 23.2 / 24.8 with 2, pairs moving 0.78-1.24x: no
# difference the machine's noise lets through.
BATCH_DRAFT_TOKENS = 1
# A batched step feeds its rows' drafts only while they are kept often enough to pay for
# widening the forward (rows are padded alike, so one row's draft widens every row): while
# the running rows' mean ``PromptLookup.hits`` (how often a draft's first token was the
# one chosen, judged on the drafts not fed too) is at least this times the row count. A
# 1-token draft a row measured +7% on a step of 4 rows and +30% on one of 8 (SmolLM2-135M
# fp32 over ~900 keys, 2-core AVX-512 EPYC, interleaved: 89 / 95 ms, 91 / 118 ms), so it
# pays above a 7% / 30% hit rate; 0.04 a row asks 16% / 32%. Extractive answers hit far
# above it; open-ended ones over these passages hit ~50% (56 steps of 8 rows fell to 37).
# Re-measured in bf16 on one machine (``scripts/step_constants.py``, docs/bench/constants-*):
# the break-even hit rate at 4 / 8 rows was 13 / 33% on SmolLM2-135M, 23 / 22% on
# Qwen2.5-Coder-0.5B, 28 / 28% on 1.5B. Kept: at 8 rows 32% is at or above each; at 4 rows
# 16% is below the larger models' by 7-12 points, which only drafts hitting between (rarer
# than the ~50% open-ended answers hit) feed at a small loss.
DRAFT_COST_PER_ROW = 0.04
# Weight of the earlier steps in a lone row's step times (compiled, eager verify).
TIME_MEMORY = 0.7


class Drafting:
    """The draft policy of one batch; only the executor's thread uses it."""

    def __init__(
        self, compiled: CompiledStep, row_cost: Callable[[int], float] | None = None
    ) -> None:
        """``row_cost(rows)``: a forward of ``rows`` rows over a lone row's time, where it
        grows with them (quantized weights); None where a few rows cost about one."""
        self.compiled = compiled
        self.row_cost = row_cost
        # A lone row's recent step times, seconds: (compiled step, eager step with a draft);
        # None until a lone row may take the compiled step
        self.times: list[float] | None = None

    def propose(self, request: Request, running: int) -> list[int]:
        """``request``'s draft for this step, while ``running`` rows decode."""
        if request.drafter is None:
            return []
        room = request.sampler.max_length - len(request.tokens) - 1  # the bonus token's
        if running > 1:
            room = min(room, BATCH_DRAFT_TOKENS)
        return request.drafter.draft(room)

    def pays(self, running: list[Request], drafts: Sequence[Sequence[int]]) -> bool:
        """Whether this step feeds ``drafts``, just proposed to ``running``."""
        if len(running) == 1:
            row = running[0]
            if row.drafter is None or not drafts[0]:
                return True
            if not self.compiled.usable or not row.compiled:
                if self.row_cost is None:
                    return True
                return row.drafter.worth + 1 >= self.row_cost(len(drafts[0]) + 1)
            if self.times is None:
                assert self.compiled.ms is not None
                self.times = [ms / 1e3 for ms in self.compiled.ms]
            compiled, verify = self.times
            return row.drafter.worth + 1 >= verify / compiled
        hits = sum(r.drafter.hits for r in running if r.drafter and r.drafter.matched)
        return hits / len(running) >= DRAFT_COST_PER_ROW * len(running)

    def timed(self, compiled: bool, drafted: bool, seconds: float) -> None:
        """A lone row's step took ``seconds``: ``compiled``, or eager feeding a draft."""
        if self.times is None or compiled == drafted:
            return  # no compiled step to weigh drafts against, or an eager step without one
        kind = 0 if compiled else 1
        self.times[kind] = TIME_MEMORY * self.times[kind] + (1 - TIME_MEMORY) * seconds
