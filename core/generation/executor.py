"""The serving loop: one thread per model runs every request's forwards.

Callers queue requests and jobs here; each turn of the loop runs one job (warming, encodes
deferred after an answer) and then one turn of the ``Batch`` (``batch.py``: admit, fill,
decode), which owns the rows of the model's KV cache.

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
caller's thread, the engine's forwards run where ``model.generate`` would. And a thread
that hands its work to the loop (a caller that waits or streams, a caller whose request
ended, the thread that made the engine) frees its own pool (``openmp.release_pool``), so
the loop's thread keeps the only one and its workers spin.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from kvboost_rag.core.generation.batch import Batch
from kvboost_rag.core.generation.job import Job
from kvboost_rag.core.generation.request import Request
from kvboost_rag.core.model import openmp
from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.measurements import Measurements
from kvboost_rag.core.model.yielding import preemptible
from kvboost_rag.core.results import BatchStats

T = TypeVar("T")
IDLE_SECONDS = 1.0  # the loop's thread ends after this long without work


class Executor:
    """Thread-safe: ``submit``, ``call`` and ``post`` may be called from any thread."""

    def __init__(self, model: Any, support: ModelSupport) -> None:
        self.model = model
        self.batch = Batch(model, support)
        self._changed = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._jobs: deque[Job] = deque()  # callers wait for these: one per turn
        self._background: deque[Job] = deque()  # nobody waits: only when nothing else runs
        self._runner: threading.Thread | None = None  # the thread running the loop
        self._thread: threading.Thread | None = None  # the background thread, while it lives
        self._idle = False  # the background thread is waiting for work (a caller may lead)
        # The thread running a background job (a caller may take the loop once it yields)
        self._job_thread: threading.Thread | None = None
        self._running: Job | None = None  # the job the loop runs now (``drain`` waits for it)
        self._arriving = 0  # callers looking a request up (``arriving``)
        self._closing = False
        self._warmed = False
        self._packs_linears = False  # whether the linear layers were measured with packing
        self._layers = support.layers  # where background forwards yield (``yielding.py``)
        self.preempted = 0  # background jobs dropped for a request, to run again
        _LIVE.add(self)

    # -- the callers' side -------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue ``request`` for the loop (run by a background thread unless a caller runs
        it); its ``done`` is set when it ends."""
        request.submitted_at = time.perf_counter()
        with self._changed:
            self._waiting.append(request)
            self._wake()
        self.hand_over()

    def run(self, request: Request) -> None:
        """Queue ``request`` and return once it has ended. The calling thread runs the loop
        meanwhile when no other thread is running it (a background thread that is idle, or
        running work nobody waits for, hands it over: that work's forward is dropped at the
        next decoder layer); when its request ends with work left, a background thread
        takes over."""
        request.submitted_at = time.perf_counter()
        me = threading.current_thread()
        with self._changed:
            self._waiting.append(request)
            background = self._runner is not None and self._runner is self._thread
            busy = self._job_thread is not None
            lead = self._runner is None or (background and (self._idle or busy))
            if lead:
                self._runner = me  # the background thread sees this and ends
            self._changed.notify_all()
            while lead and self._job_thread is not None:  # until its forward is dropped
                self._changed.wait()
        if not lead:
            self.hand_over()
            request.done.wait()
            return
        try:
            while not request.done.is_set():
                self._run_turn()
        finally:
            with self._changed:
                self._runner = None
            openmp.release_pool()
            with self._changed:
                self._wake()  # the rest, or the background thread's idle wait and cleanup

    def hand_over(self) -> None:
        """On a thread that leaves the forwards to the loop: free its OpenMP pool, unless it
        runs the loop."""
        if threading.current_thread() is not self._runner:
            openmp.release_pool()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop's thread between turns (inline when already on it, or
        inside a background job, whose thread a caller may have taken the loop from)."""
        if threading.current_thread() in (self._runner, self._job_thread):
            return fn()
        job = Job(fn)
        with self._changed:
            self._jobs.append(job)
            self._wake()
        return job.wait()  # type: ignore[no-any-return]

    def post(self, fn: Callable[[], object]) -> Job:
        """Queue ``fn`` for the loop's thread without waiting for it. It runs once no
        request is waiting, building or decoding (work deferred after an answer must not
        delay the next one), and a request or a caller's job arriving meanwhile drops its
        forward between two decoder layers (``yielding.py``): ``fn`` then runs again from
        its start once none is left, so it must be safe to repeat. ``Job.wait`` waits for
        it."""
        job = Job(fn)
        with self._changed:
            self._background.append(job)
            self._wake()
        return job

    def warm_up(
        self, packed: bool | None, packed_linears: bool, measurements: Measurements
    ) -> None:
        """Once per executor (the first engine on its model): ``Runner.prepare`` on the
        loop's thread (what steers the forwards, recalled from ``measurements`` or
        measured), then ``Runner.first_use`` queued as background work, so no request
        pays first-use costs and none waits for them. A later engine that lets the linear
        layers pack, where none before did, measures them again with packing."""
        with self._changed:
            first, again = not self._warmed, packed_linears and not self._packs_linears
            self._warmed = True
            self._packs_linears |= packed_linears
        runner = self.batch.runner
        if first:
            self.call(lambda: runner.prepare(packed, packed_linears, measurements))
            self.post(lambda: runner.first_use(0, packed))  # no row is held
        elif again:
            self.call(lambda: runner.measure(True, measurements))

    def compile_step(self, choice: str) -> None:
        """For an engine whose ``compiled_step`` is not "off": compile the one-row step on
        the loop's thread, once per executor, in row 0 while no request holds a row (else
        it stays eager, with the reason)."""
        if choice == "off":
            return
        batch = self.batch

        def compile_now() -> None:
            if batch.rows:
                state = batch.runner.compiled
                if state.state == "off":
                    state.state = "eager: requests held rows when an engine asked to compile"
                return
            batch.runner.compile_step(0, measured=choice == "measured")

        self.call(compile_now)

    @contextmanager
    def arriving(self) -> Iterator[None]:
        """While a caller prepares a request (its lookup: index updates, tier reads), work
        nobody waits for pauses: a running forward is dropped at the next decoder layer
        and none starts, so the request is not slowed or queued behind it. Never hold it
        while waiting for such work."""
        with self._changed:
            self._arriving += 1
        try:
            yield
        finally:
            with self._changed:
                self._arriving -= 1
                self._wake()

    def drain(self) -> None:
        """Wait until every job queued so far (deferred ones too) has run."""
        with self._changed:
            running = [] if self._running is None else [self._running]
            jobs = [*running, *self._jobs, *self._background]
        for job in jobs:
            job.done.wait()

    def stats(self) -> BatchStats:
        return self.batch.stats()

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
            self.batch.fail_all(error)

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
            self.batch.slots.clear()
            return False

    def _pending(self) -> bool:
        background = bool(self._background) and not self._arriving
        return bool(self.batch.rows or self._waiting or self._jobs or background)

    def _turn(self) -> None:
        with self._changed:
            job = self._jobs.popleft() if self._jobs else None
            background = job is None and bool(self._background)
            if background and not (self.batch.rows or self._waiting or self._arriving):
                job = next((j for j in self._background if j.urgent), self._background[0])
                self._background.remove(job)
            self._running = job
        try:
            if job is not None and background:
                self._run_background(job)
            elif job is not None:
                job.run()
        finally:
            with self._changed:
                self._running = None
        if threading.current_thread() is not self._runner:
            return  # a caller took the loop over while a background job yielded
        self.batch.turn(self._next_waiting)

    def _run_background(self, job: Job) -> None:
        """Run ``job`` until a request or a caller's job arrives; dropped, it goes back to
        the front of the queue."""
        finished = False
        with self._changed:
            self._job_thread = threading.current_thread()
        try:
            with preemptible(self._layers, self._arrived):
                finished = job.run()
        finally:
            with self._changed:
                self._job_thread = None
                if not finished:
                    self.preempted += 1
                    self._background.appendleft(job)
                self._changed.notify_all()

    def _arrived(self) -> bool:
        """Whether a request or a caller's job waits, or a request is being looked up (read
        without the lock: a late answer only delays the yield by a layer)."""
        return bool(self._waiting or self._jobs or self._arriving)

    def _next_waiting(self) -> Request | None:
        """The first waiting request, taken off the queue, if the batch admits it."""
        with self._changed:
            if self._waiting and self.batch.admits(self._waiting[0]):
                return self._waiting.popleft()
            return None

    def close(self) -> None:
        """At interpreter exit: cancel every request, run the deferred jobs (their stores
        are kept, as the tiers keep their queued writes) and end the thread."""
        with self._changed:
            self._closing = True
            for request in [*self._waiting, *self.batch.rows]:
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
