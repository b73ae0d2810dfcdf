"""The serving loop: one thread per model runs every request's forwards.

nano-vllm's shape: each turn of the loop *schedules* (admits waiting requests whose
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
- Decode forwards feed each running row its last token.
- Jobs (warming, encodes deferred after an answer) run between turns, one per turn.

Requests decode together only while every one's engine allows the batch
(``KVBoostConfig.max_batch_size``); with 1 the loop serves one request at a time.

Which thread runs the loop: a caller that blocks on its answer (``run``) runs it itself
when no other thread does, until its request ends; otherwise (streams, a loop already
running, work left when that caller's request ends) a background thread does. On a CPU the
thread matters: torch's OpenMP runtime gives each thread that runs parallel work a pool of
its own, and once more pool threads exist than cores (the caller's pool from loading the
model, plus the loop thread's), its workers stop spinning between parallel regions and
sleep, so each of a decoding step's hundreds of small regions pays a wake-up. Measured on
SmolLM2-135M (bf16, 2 cores): a decoding step took 60 ms on the thread that loaded the
model and 130-150 ms on a new thread, 69-90 ms there with one OpenMP thread. Run on the
caller's thread, the engine's forwards run where ``model.generate`` would.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvboost_rag.core.generation.request import Request, Status
from kvboost_rag.core.generation.result import BatchStats
from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.generation.slots import SlotCache
from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.kv import LayerKV

T = TypeVar("T")
IDLE_SECONDS = 1.0  # the loop's thread ends after this long without work
# Fill tokens per turn while other requests decode: a build then delays their next token
# by one such forward, not by the whole prompt. Smaller chunks cost more per token (each
# re-reads the row's cached keys; 512 measured 1.18 ms per prompt token against 0.88 for a
# whole ~830-token prompt), so a typical RAG prompt is one chunk.
FILL_TOKENS = 1024
# Building rows filled in one forward. On a CPU a forward is compute-bound: rows filled
# together gain nothing and take the masked, padded path (measured on SmolLM2, bf16, 2
# cores: 1.25 ms per prompt token for 2-3 rows filled together, 0.88 for one alone), so a
# CPU fills one row a turn; an accelerator batches them.
FILL_ROWS = {"cpu": 1}
# Drafted tokens per row when several rows decode at once: each is one more query row in
# every row's forward (rows are padded to the longest draft), so a short draft pays where
# a request's own 8 would not. 8 concurrent 256-token answers (SmolLM2-135M fp32, 2-core
# AVX2 EPYC, docs/bench/decode-concurrent-float32.txt) measured 45.4 against 37.1 tokens/s
# extractive and 41.8 against 33.5 open-ended with 2 drafted and none. At 64 tokens, where
# the 8 prefills take most of the time, 2 was below none open-ended (18.5 against 22.8);
# one step of 8 rows over ~900 keys took ~170 / ~200 / ~250 ms feeding 1 / 2 / 3 tokens a
# row, and in one run of every choice, twice, 1 drafted measured 12.7-13.2 tokens/s
# open-ended against 12.6-12.8 for none and 11.7-12.4 for 2 (extractive 14.3 twice for 1,
# 13.6-15.0 for none, 12.6-14.8 for 2; greedy answers identical throughout).
BATCH_DRAFT_TOKENS = 1


class Job:
    """A function to run on the loop's thread; ``wait`` returns its result."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as error:  # handed to the waiting caller
            self.error = error
        finally:
            self.done.set()

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Row:
    """A request's row, as its owner's context build sees it (``RowKV``)."""

    def __init__(self, slots: SlotCache, index: int) -> None:
        self._slots = slots
        self.index = index

    def write(self, start: int, kv: LayerKV) -> None:
        self._slots.write_kv(self.index, start, kv)

    def zero(self, start: int, end: int) -> None:
        self._slots.zero(self.index, start, end)

    def views(self, start: int, end: int) -> LayerKV:
        return self._slots.views(self.index, start, end)

    def copy(self, start: int, end: int) -> LayerKV:
        return self._slots.read(self.index, start, end)

    @property
    def length(self) -> int:
        return self._slots.lengths[self.index]


class Executor:
    """Thread-safe: ``submit``, ``call`` and ``post`` may be called from any thread."""

    def __init__(self, model: Any, support: ModelSupport) -> None:
        self.model = model
        self.slots = SlotCache(len(support.layer_types))
        self.runner = Runner(model, support, self.slots)
        self._changed = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._jobs: deque[Job] = deque()  # callers wait for these: one per turn
        self._background: deque[Job] = deque()  # nobody waits: only when nothing else runs
        self._rows: list[Request] = []  # by row: the running ones first, then building ones
        self._runner: threading.Thread | None = None  # the thread running the loop
        self._thread: threading.Thread | None = None  # the background thread, while it lives
        self._idle = False  # the background thread is waiting for work (a caller may lead)
        self._closing = False
        self._steps = self._stepped_rows = self._peak = 0
        self._seconds = 0.0
        self._fill_rows = FILL_ROWS.get(torch.device(model.device).type)
        self._warmed = False
        _LIVE.add(self)

    # -- the callers' side -------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue ``request`` for the loop (run by a background thread unless a caller runs
        it); its ``done`` is set when it ends."""
        request.submitted_at = time.perf_counter()
        with self._changed:
            self._waiting.append(request)
            self._wake()

    def run(self, request: Request) -> None:
        """Queue ``request`` and return once it has ended. The calling thread runs the loop
        meanwhile when no other thread is running it (an idle background thread hands it
        over); when its request ends with work left, a background thread takes over."""
        request.submitted_at = time.perf_counter()
        me = threading.current_thread()
        with self._changed:
            self._waiting.append(request)
            lead = self._runner is None or (self._runner is self._thread and self._idle)
            if lead:
                self._runner = me  # an idle background thread sees this and ends
            self._changed.notify_all()
        if not lead:
            request.done.wait()
            return
        try:
            while not request.done.is_set():
                self._run_turn()
        finally:
            with self._changed:
                self._runner = None
                self._wake()  # the rest, or the background thread's idle wait and cleanup

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop's thread between turns (inline when already on it)."""
        if threading.current_thread() is self._runner:
            return fn()
        job = Job(fn)
        with self._changed:
            self._jobs.append(job)
            self._wake()
        return job.wait()  # type: ignore[no-any-return]

    def post(self, fn: Callable[[], object]) -> Job:
        """Queue ``fn`` for the loop's thread without waiting for it. It runs once no
        request is waiting, building or decoding (work deferred after an answer must not
        delay the next one); ``Job.wait`` waits for it."""
        job = Job(fn)
        with self._changed:
            self._background.append(job)
            self._wake()
        return job

    def warm_up(self, packed: bool | None) -> None:
        """Once per executor (the first engine on its model): run ``Runner.warm_up`` on
        the loop's thread, in a row no request holds, so no request pays first-use costs."""
        with self._changed:
            if self._warmed:
                return
            self._warmed = True
        self.call(lambda: self.runner.warm_up(len(self._rows), packed))

    def drain(self) -> None:
        """Wait until every job queued so far (deferred ones too) has run."""
        with self._changed:
            jobs = [*self._jobs, *self._background]
        for job in jobs:
            job.done.wait()

    def stats(self) -> BatchStats:
        return BatchStats(self._steps, self._stepped_rows, self._peak, self._seconds)

    def _wake(self) -> None:
        """Under ``_changed``: start the background thread if no thread runs the loop."""
        if self._runner is None and self._thread is None:
            self._thread = self._runner = threading.Thread(
                target=self._loop, name="kvboost-executor", daemon=True
            )
            self._thread.start()
        self._changed.notify_all()

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        """The background thread's body."""
        while self._work_ready():
            self._run_turn()

    def _run_turn(self) -> None:
        try:
            with torch.inference_mode():
                self._turn()
        except BaseException as error:  # the batch could not be kept: fail its requests
            for request in list(self._rows):
                self._fail(request, error)

    def _work_ready(self) -> bool:
        """On the background thread: wait for work; False (the thread ends) once a caller
        runs the loop, or after ``IDLE_SECONDS`` without work (the rows are freed)."""
        me = threading.current_thread()
        with self._changed:
            while True:
                if self._runner is None:  # a caller left the loop: take it back
                    self._runner = me
                if self._runner is not me:
                    self._thread = None
                    return False
                if self._pending():
                    return True
                if self._closing:
                    break
                self._idle = True
                woken = self._changed.wait(IDLE_SECONDS)
                self._idle = False
                if not woken and self._runner is me and not self._pending():
                    break
            self._runner = self._thread = None
            self.slots.clear()
            return False

    def _pending(self) -> bool:
        return bool(self._rows or self._waiting or self._jobs or self._background)

    def _turn(self) -> None:
        with self._changed:
            job = self._jobs.popleft() if self._jobs else None
            if job is None and self._background and not (self._rows or self._waiting):
                job = self._background.popleft()
        if job is not None:
            job.run()
        self._end_cancelled()
        self._admit()
        self._fill()
        self._decode()

    # -- schedule ----------------------------------------------------------------------

    def _running(self) -> int:
        return sum(r.status is Status.RUNNING for r in self._rows)

    def _admit(self) -> None:
        """Waiting requests take rows while every engine involved allows the batch."""
        while True:
            with self._changed:
                if not self._waiting:
                    return
                request = self._waiting[0]
                limit = min(r.limit for r in [*self._rows, request])
                if len(self._rows) >= limit:
                    return
                self._waiting.popleft()
            if request.cancel.is_set():
                self._end(request, None)
                continue
            self._build(request)

    def _build(self, request: Request) -> None:
        row = len(self._rows)
        self._rows.append(request)
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
        building = [r for r in self._rows if r.status is Status.BUILDING]
        budget = FILL_TOKENS if self._running() else None
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
        rows = [self._rows.index(r) for r, _ in plan]
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
        index, first_free = self._rows.index(request), self._running()
        if index != first_free:
            self.slots.swap_rows(index, first_free)
            self._rows[index], self._rows[first_free] = self._rows[first_free], request
        request.status = Status.RUNNING

    def _decode(self) -> None:
        """One forward over the running rows: each feeds its last token and, where its
        text suggests what follows, a draft to verify (``speculation.py``)."""
        count = self._running()
        if not count:
            return
        start = time.perf_counter()
        running = self._rows[:count]
        drafts = [self._draft(r) for r in running]
        tokens = [[r.tokens[-1], *d] for r, d in zip(running, drafts)]
        positions = [
            list(range(len(r.tokens) - 1, len(r.tokens) + len(d))) for r, d in zip(running, drafts)
        ]
        keep = max(map(len, tokens))
        try:
            packed = [r.packed for r in running]
            logits = self.runner.run_rows(list(range(count)), tokens, positions, keep, packed)
        except BaseException as error:
            for request in running:
                self._fail(request, error)
            return
        # Counted before any request ends: a caller woken by its last token reads them.
        self._steps += 1
        self._stepped_rows += count
        self._peak = max(self._peak, count)
        for i, (request, draft) in enumerate(zip(running, drafts)):
            self._accept(request, logits[i, keep - 1 - len(draft) :], draft)
        self._seconds += time.perf_counter() - start

    def _draft(self, request: Request) -> list[int]:
        if request.drafter is None:
            return []
        room = request.sampler.max_length - len(request.tokens) - 1  # the bonus token's
        if self._running() > 1:
            room = min(room, BATCH_DRAFT_TOKENS)
        return request.drafter.draft(room)

    def _accept(self, request: Request, logits: Any, draft: list[int]) -> None:
        """Keep what the sampler accepts of ``draft`` (and its own next token), stream it,
        and end the request when it is finished."""
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
            request.drafter.extend(chosen)
            request.drafter.kept(len(draft), kept)
        # Positions past the kept tokens hold a rejected draft's KV: no longer part of the row.
        self.slots.crop(self._rows.index(request), len(request.tokens) - 1)
        if finished:
            self._end(request, None)

    def _end_cancelled(self) -> None:
        for request in [r for r in self._rows if r.cancel.is_set()]:
            self._end(request, None)

    # -- ending requests ---------------------------------------------------------------

    def _fail(self, request: Request, error: BaseException) -> None:
        self._end(request, error)

    def _end(self, request: Request, error: BaseException | None) -> None:
        """Finish ``request``: its owner stores what it wants from the row, the row is
        freed, and the caller is woken."""
        request.ended_at = time.perf_counter()
        request.error = error
        row = self._rows.index(request) if request in self._rows else None
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
        if self._rows[row].status is Status.RUNNING:
            last_running = self._running() - 1  # this request still counts as running
            self._move(last_running, row)
            row = last_running  # the hole is now right after the other running rows
        self._move(len(self._rows) - 1, row)
        self._rows.pop()

    def _move(self, source: int, target: int) -> None:
        if source != target:
            self.slots.move_row(source, target)
            self._rows[target] = self._rows[source]

    def close(self) -> None:
        """At interpreter exit: cancel every request, run the deferred jobs (their stores
        are kept, as the tiers keep their queued writes) and end the thread."""
        with self._changed:
            self._closing = True
            for request in [*self._waiting, *self._rows]:
                request.cancel.set()
            thread = self._thread
            self._changed.notify_all()
        if thread is not None:
            thread.join()


# Executors whose thread may still run. A daemon thread still inside torch when the
# interpreter finalizes aborts the process, so at exit each is told to cancel its requests
# and joined.
_LIVE: weakref.WeakSet[Executor] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for executor in list(_LIVE):
        executor.close()
