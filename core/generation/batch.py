"""The rows decoding together: one turn schedules, runs and postprocesses them.

nano-vllm's shape, for the executor's thread (``executor.py`` owns the thread and the
queues; this module owns the rows): each turn *schedules* (admits waiting requests whose
context can be built, picks the rows to fill and to decode), *runs* forwards through the
``Runner`` and *postprocesses* (picks tokens, streams them, ends requests). One decode path
serves every batch size: a batch of one is a batch whose forward needs no mask.

- Admission builds a request's context in a free row: the KV its lookup found, passages
  it must encode, the repair's choice of positions. Storage is never touched here: the
  lookup ran on the caller's thread, and stores after an answer are queued by the owner.
- Fill forwards compute the positions a context still needs (a cold prefill, the tail
  after a cached prefix, a repair pass), for every building row at once. While others
  decode, each turn feeds at most ``FILL_TOKENS`` of them, so streams keep flowing
  (chunked prefill); a row's last fill picks its first token.
- Decode forwards feed each running row its last token and, where its text suggests what
  follows, a draft to verify (``speculation.py``).

Not thread-safe: only the thread running the executor's loop touches a ``Batch``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvboost_rag.core.generation.drafting import Drafting
from kvboost_rag.core.generation.request import Request, Status
from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.generation.slots import Row, SlotCache, position_bytes
from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.quantized import row_cost
from kvboost_rag.core.results import BatchStats

# Fill tokens per turn while other requests decode: a build then delays their next token
# by one such forward, not by the whole prompt. Smaller chunks cost more per token (each
# re-reads the row's cached keys; 512 measured 1.18 ms per prompt token against 0.88 for a
# whole ~830-token prompt), so a typical RAG prompt is one chunk. At Qwen2.5-Coder-1.5B
# (bf16, twice): chunks of 512 cost 1.07-1.09x and of 256 1.35-1.40x the whole prompt's
# time per token (``scripts/step_constants.py --parts fill``, docs/bench/constants-*). Kept.
FILL_TOKENS = 1024
# Building rows filled in one forward. On a CPU a forward is compute-bound: rows filled
# together gain nothing and take the masked, padded path (measured on SmolLM2, bf16, 2
# cores: 1.25 ms per prompt token for 2-3 rows filled together, 0.88 for one alone), so a
# CPU fills one row a turn; an accelerator batches them. At Qwen2.5-Coder-1.5B (bf16, twice)
# two rows of 830 tokens together cost 1.06-1.13x one alone per token, 1.13-1.37x padded
# to the longer (``scripts/step_constants.py --parts fill``, docs/bench/constants-*). Kept.
FILL_ROWS = {"cpu": 1}


def _positions(request: Request) -> int:
    """The most positions ``request``'s row can need: its prompt, then its answer (and a
    draft verified past it), or the tokens a logits-only request feeds."""
    if request.feed is not None:
        return len(request.prompt.tokens) + len(request.feed) + 1
    draft = 0 if request.drafter is None else request.drafter.max_draft
    return len(request.prompt.tokens) + request.sampling.max_new_tokens + draft + 1


class Batch:
    """Every request holding a row of the model's KV cache, and the forwards that serve
    them. Rows are ordered: the running ones first, then the building ones."""

    def __init__(self, model: Any, support: ModelSupport) -> None:
        self.slots = SlotCache(len(support.layer_types), position_bytes(model))
        self.runner = Runner(model, support, self.slots)
        self.drafting = Drafting(self.runner.compiled, row_cost(model))
        self.rows: list[Request] = []
        self._fill_rows = FILL_ROWS.get(torch.device(model.device).type)
        self._steps = self._stepped_rows = self._peak = 0
        self._seconds = 0.0

    def turn(self, next_waiting: Callable[[], Request | None]) -> None:
        """One turn: end cancelled requests, admit what ``next_waiting`` hands over (it
        returns None when nothing may be admitted), feed building rows, decode running ones."""
        self._end_cancelled()
        self._admit(next_waiting)
        self._fill()
        self._decode()

    def fail_all(self, error: BaseException) -> None:
        """A turn failed where the batch could not be kept: every request in it fails with
        ``error`` and every row is dropped. No row's KV is moved (the turn may have left
        them half-written), so ending them cannot fail in turn."""
        requests, self.rows = self.rows, []
        for request in requests:
            self._end(request, error)

    def stats(self) -> BatchStats:
        compiled = self.runner.compiled
        counts = (self._steps, self._stepped_rows, self._peak, self._seconds)
        return BatchStats(
            *counts,
            compiled.steps,
            compiled.state,
            compiled.ms,
            compiled.compile_seconds,
            self.slots.peak_bytes,
        )

    # -- schedule ----------------------------------------------------------------------

    def running(self) -> int:
        return sum(r.status is Status.RUNNING for r in self.rows)

    def admits(self, request: Request) -> bool:
        """Whether ``request`` may take a row: every engine involved allows the batch, and
        its KV budget holds the rows with room for every one's whole answer (a request
        alone always runs)."""
        rows = [*self.rows, request]
        if len(self.rows) >= min(r.limit for r in rows):
            return False
        # Rows share one width, which shrinks only once the batch is empty (``_build``).
        width = max(self.slots.capacity - 1, *map(_positions, rows))
        return not self.rows or self.slots.bytes_for(len(rows), width) <= min(
            r.kv_budget for r in rows
        )

    def _admit(self, next_waiting: Callable[[], Request | None]) -> None:
        """Waiting requests take rows while ``next_waiting`` hands one over."""
        while (request := next_waiting()) is not None:
            if request.cancel.is_set():
                self._end(request, None)
                continue
            self._build(request)

    def _build(self, request: Request) -> None:
        row = len(self.rows)
        self.rows.append(request)
        self.slots.budget = budget = min(r.kv_budget for r in self.rows)
        wide = self.slots.capacity - 1 > _positions(request)
        if row == 0 and wide and self.slots.bytes_for(2, self.slots.capacity - 1) > budget:
            self.slots.clear()  # rows as wide as an earlier long prompt's would fit fewer
        self.slots.reserve(row + 1, len(request.prompt.tokens))
        self.slots.lengths[row] = 0
        request.status = Status.BUILDING
        request.timings.wait_ms = (time.perf_counter() - request.submitted_at) * 1e3
        try:
            request.context = request.owner.build(request, Row(self.slots, row))
        except BaseException as error:  # this request's own failure (an encode, a probe)
            self._fail(request, error)
            return
        request.fill = list(request.context.fill)
        if request.feed is not None:
            after = request.plan.length + 1
            request.fill += range(after, after + len(request.feed))
        request.filled_at = time.perf_counter()

    def _fill_plan(self) -> list[tuple[Request, int]]:
        """Building rows and how many positions each feeds this turn: all of them when no
        row is decoding, else ``FILL_TOKENS`` in all, the earliest admitted first; at most
        ``FILL_ROWS`` rows of them."""
        building = [r for r in self.rows if r.status is Status.BUILDING]
        budget = FILL_TOKENS if self.running() else None
        plan: list[tuple[Request, int]] = []
        for request in building:
            if request.feed is not None:  # logits after several tokens: a forward of its own
                return plan or [(request, len(request.fill))]
            take = len(request.fill) if budget is None else min(len(request.fill), budget)
            if take == 0:
                break
            plan.append((request, take))
            if budget is not None:
                budget -= take
            if len(plan) == self._fill_rows:
                break
        return plan

    # -- run and postprocess -----------------------------------------------------------

    def _fill(self) -> None:
        plan = self._fill_plan()
        if not plan:
            return
        rows = [self.rows.index(r) for r, _ in plan]
        tokens, positions = [], []
        for request, take in plan:
            chunk = request.fill[:take]
            positions.append(chunk)
            tokens.append([self._token_at(request, p) for p in chunk])
        keep = 1 + (len(plan[0][0].feed or []) if len(plan) == 1 else 0)
        try:
            packed = [r.packed for r, _ in plan]
            logits = self.runner.run_rows(rows, tokens, positions, keep, packed)
        except BaseException as error:  # the forward failed: every request in it fails
            for request, _ in plan:
                self._fail(request, error)
            return
        for i, (request, take) in enumerate(plan):
            request.fill = request.fill[take:]
            if not request.fill:
                self._first_token(request, logits[i])

    def _token_at(self, request: Request, position: int) -> int:
        prompt = request.prompt.tokens
        return prompt[position] if position < len(prompt) else request.feed[position - len(prompt)]  # type: ignore[index]

    def _first_token(self, request: Request, logits: Any) -> None:
        request.timings.prefill_ms = (time.perf_counter() - request.filled_at) * 1e3
        if request.feed is not None:
            request.logits = logits
            self._end(request, None)
            return
        self._start_running(request)
        self._accept(request, logits[-1:], [])

    def _start_running(self, request: Request) -> None:
        """A built row becomes a running one: it moves next to the running rows."""
        index, first_free = self.rows.index(request), self.running()
        if index != first_free:
            self.slots.swap_rows(index, first_free)
            self.rows[index], self.rows[first_free] = self.rows[first_free], request
        request.status = Status.RUNNING

    def _decode(self) -> None:
        """One forward over the running rows: each feeds its last token and, where its
        text suggests what follows, a draft to verify (``speculation.py``)."""
        count = self.running()
        if not count:
            return
        start = time.perf_counter()
        running = self.rows[:count]
        proposals = [self.drafting.propose(r, count) for r in running]
        drafts = proposals if self.drafting.pays(running, proposals) else [[] for _ in running]
        compiled_before = self.runner.compiled.steps
        tokens = [[r.tokens[-1], *d] for r, d in zip(running, drafts)]
        positions = [
            list(range(len(r.tokens) - 1, len(r.tokens) + len(d))) for r, d in zip(running, drafts)
        ]
        keep = max(map(len, tokens))
        try:
            packed = [r.packed for r in running]
            compiled = all(r.compiled for r in running)
            logits = self.runner.run_rows(
                list(range(count)), tokens, positions, keep, packed, compiled
            )
        except BaseException as error:
            for request in running:
                self._fail(request, error)
            return
        # Counted before any request ends: a caller woken by its last token reads them.
        self._steps += 1
        self._stepped_rows += count
        self._peak = max(self._peak, count)
        for i, (request, draft) in enumerate(zip(running, drafts)):
            self._accept(request, logits[i, keep - 1 - len(draft) :], draft, proposals[i])
        seconds = time.perf_counter() - start
        self._seconds += seconds
        if count == 1:
            self.drafting.timed(self.runner.compiled.steps > compiled_before, any(drafts), seconds)

    def _accept(
        self, request: Request, logits: Any, draft: list[int], proposal: Sequence[int] = ()
    ) -> None:
        """Keep what the sampler accepts of ``draft`` (and its own next token), stream it,
        and end the request when it is finished. ``proposal``: the draft this step's
        drafter offered, fed (then ``draft``) or not; judged against the chosen token."""
        try:
            chosen, kept = request.sampler.verify(request.tokens, logits, draft)
            request.drafted += len(draft)
            request.accepted += kept
            for token in chosen:
                request.emit(token)
            finished = request.sampler.finished(request.tokens)
        except BaseException as error:  # a processor or a stream callback: this one only
            self._fail(request, error)
            return
        if request.drafter is not None:
            if proposal:
                request.drafter.judged(proposal[0], chosen[0])
            request.drafter.extend(chosen)
        # Positions past the kept tokens hold a rejected draft's KV: no longer part of the row.
        self.slots.crop(self.rows.index(request), len(request.tokens) - 1)
        if finished:
            self._end(request, None)

    def _end_cancelled(self) -> None:
        for request in [r for r in self.rows if r.cancel.is_set()]:
            self._end(request, None)

    # -- ending requests ---------------------------------------------------------------

    def _fail(self, request: Request, error: BaseException) -> None:
        self._end(request, error)

    def _end(self, request: Request, error: BaseException | None) -> None:
        """Finish ``request``: its owner stores what it wants from the row, the row is
        freed, and the caller is woken."""
        request.ended_at = time.perf_counter()
        request.error = error
        row = self.rows.index(request) if request in self.rows else None
        try:
            if error is None:
                request.result = request.owner.result(request)
                if row is not None:
                    started = time.perf_counter()
                    request.owner.finished(request, Row(self.slots, row))
                    request.timings.store_ms = (time.perf_counter() - started) * 1e3
        except BaseException as failure:  # building the result or queueing its stores
            request.error = failure
        if row is not None:
            self._release(row)
        request.status = Status.FINISHED
        if request.on_end is not None:
            try:
                request.on_end(request)
            except BaseException as failure:  # a stream's hand-off: the caller still wakes
                request.error = request.error or failure
        request.done.set()

    def _release(self, row: int) -> None:
        """Free ``row``, keeping the running rows first and contiguous."""
        if self.rows[row].status is Status.RUNNING:
            last_running = self.running() - 1  # this request still counts as running
            self._move(last_running, row)
            row = last_running  # the hole is now right after the other running rows
        self._move(len(self.rows) - 1, row)
        self.rows.pop()

    def _move(self, source: int, target: int) -> None:
        if source != target:
            self.slots.move_row(source, target)
            self.rows[target] = self.rows[source]
