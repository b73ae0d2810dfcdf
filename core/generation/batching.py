"""Continuous batching: requests whose context is built decode together.

Each request builds its context alone under the model lock (exact prefix, passages,
repair) and picks its first token there, so its time to first token does not wait for
anyone's answer. Then it joins the model's ``Batcher``: one forward per step over every
active request, each with its own sampling, stop strings, length, stream and cancel.
Requests join and leave at step boundaries; a finished request takes its KV out at once.

Why not transformers' ``ContinuousBatchingManager``: it takes token ids and prefills them
itself into its paged cache (sharing exact blocks at most), so the reused, re-positioned
and repaired passage KV the engine builds cannot enter it, and per request it offers
temperature / top-k / top-p, not generate's whole processor list (repetition penalty, a
grammar's mask). What comes from transformers: the model's forward over a left-padded
``DynamicCache`` with an attention mask and per-row positions, and generate's own logits
processors and stopping criteria per request, so a request decodes what generate would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList

from kvboost_rag.core.generation.result import BatchStats
from kvboost_rag.core.generation.streaming import Cancelled, TokenCollector
from kvboost_rag.core.model.kv import LayerKV, row_views, stack_rows, to_cache

# Seconds a batcher thread waits for work before it ends (a new request starts another).
IDLE_SECONDS = 1.0


@dataclass(eq=False)
class Job:
    """One request's decoding: what it has chosen so far and how it chooses the next."""

    tokens: list[int]  # the prompt and every token chosen so far
    kv: LayerKV  # KV of ``tokens[:-1]``: the last token is the next step's input
    do_sample: bool
    processors: LogitsProcessorList  # generate's own, built from the request's config
    stopping: StoppingCriteriaList  # generate's own (length, eos, stop strings) + cancel
    generator: torch.Generator | None  # the request's seeded random stream, if seeded
    collector: TokenCollector
    cancel: Cancelled
    limit: int  # the most requests its engine lets decode in one batch
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def choose(self, logits: torch.Tensor) -> bool:
        """Pick the next token from one row of next-token logits, as generate's sampling
        loop does; hand it to the collector; True when the request is finished."""
        ids = torch.tensor([self.tokens], device=logits.device)
        scores = self.processors(ids, logits[None])  # type: ignore[arg-type]
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        else:
            token = int(scores.argmax())
        self.tokens.append(token)
        finished = bool(self.stopping(torch.tensor([self.tokens]), None).any())
        self.collector.put(torch.tensor([token]))
        return finished

    def cache(self, config: Any) -> DynamicCache:
        """The request's KV as a fresh cache (positions of ``tokens[:-1]``)."""
        return to_cache(self.kv, config)

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class Batcher:
    """Decodes the jobs of every engine sharing one model, in one forward per step.

    Locking: a step's forward holds the model lock; requests building their context
    announce it (``priority``) and steps wait until none is, so a new request joins
    within one step instead of waiting for the batch to finish.
    """

    def __init__(self, model: Any, lock: threading.RLock) -> None:
        self._model = model
        self._lock = lock
        self._changed = threading.Condition()
        self._waiting: list[Job] = []  # submitted, not yet in the batch
        self._rows: list[Job] = []  # in the batch, in row order (used by the thread only)
        self._cache: DynamicCache | None = None
        self._pads: list[int] = []
        self._wanting = 0  # requests building a context or storing one's KV
        self._thread: threading.Thread | None = None
        self._steps = self._stepped_rows = self._peak = 0
        self._seconds = 0.0

    def stats(self) -> BatchStats:
        return BatchStats(self._steps, self._stepped_rows, self._peak, self._seconds)

    @contextmanager
    def priority(self) -> Iterator[None]:
        """Hold decoding steps back while the caller works on the model (under its lock)."""
        with self._changed:
            self._wanting += 1
        try:
            yield
        finally:
            with self._changed:
                self._wanting -= 1
                self._changed.notify_all()

    def submit(self, job: Job) -> None:
        with self._changed:
            self._waiting.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="kvboost-batch", daemon=True
                )
                self._thread.start()
            self._changed.notify_all()

    def _loop(self) -> None:
        while True:
            try:
                if not self._next_batch():
                    return
                start = time.perf_counter()
                finished = self._step()
                self._seconds += time.perf_counter() - start
                if finished:
                    self._release(finished)
            except BaseException as error:  # restacking failed (out of memory): fail them all
                self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        """End every job with ``error``, so no request waits on a batch that is gone."""
        with self._changed:
            jobs, self._waiting = self._rows + self._waiting, []
        self._rows, self._cache = [], None
        for job in jobs:
            job.error = error
            job.done.set()

    def _next_batch(self) -> bool:
        """Wait for work and for requests building a context; admit waiting jobs. False
        when idle long enough to end the thread."""
        with self._changed:
            while not self._rows and not self._waiting:
                if not self._changed.wait(IDLE_SECONDS) and not self._waiting:
                    self._thread = None
                    return False
            while self._wanting:
                self._changed.wait()
            joining = self._admit()
        if joining or self._cache is None:
            self._restack(joining)
        return True

    def _admit(self) -> list[Job]:
        room = min([job.limit for job in self._rows + self._waiting[:1]]) - len(self._rows)
        joining, self._waiting = self._waiting[: max(room, 0)], self._waiting[max(room, 0) :]
        return joining

    def _restack(self, joining: list[Job]) -> None:
        """Rebuild the batch cache from the rows' KV and the joining jobs'."""
        if self._cache is not None:
            for row, job in enumerate(self._rows):
                job.kv = row_views(self._cache, row, self._pads[row])
        self._rows += joining
        self._cache = None
        if self._rows:
            self._cache, self._pads = stack_rows([job.kv for job in self._rows])
        for job in self._rows:
            job.kv = []  # held by the batch cache now

    def _step(self) -> list[int]:
        """One forward over every row, one token chosen per row; the finished rows."""
        try:
            logits = self._forward()
        except BaseException as error:  # the model failed: every request in it fails
            for job in self._rows:
                job.error = error
            return list(range(len(self._rows)))
        finished = []
        for row, job in enumerate(self._rows):
            try:
                if job.choose(logits[row]):
                    finished.append(row)
            except BaseException as error:  # a processor or a stream callback: this one
                job.error = error
                finished.append(row)
        return finished

    def _forward(self) -> torch.Tensor:
        assert self._cache is not None
        width = self._cache.get_seq_length()
        rows = len(self._rows)
        device = self._model.device
        mask = torch.ones((rows, width + 1), dtype=torch.long, device=device)
        for row, pad in enumerate(self._pads):
            mask[row, :pad] = 0
        ids = torch.tensor([[job.tokens[-1]] for job in self._rows], device=device)
        positions = torch.tensor([[len(job.tokens) - 1] for job in self._rows], device=device)
        self._steps += 1
        self._stepped_rows += rows
        self._peak = max(self._peak, rows)
        with self._lock, torch.inference_mode():
            out = self._model(
                input_ids=ids, attention_mask=mask, position_ids=positions, cache=self._cache
            )
        return out.logits[:, -1].to(dtype=torch.float32)

    def _release(self, finished: list[int]) -> None:
        """Hand finished jobs a copy of their KV and wake their requests; the others
        are restacked before the next step."""
        assert self._cache is not None
        keep = []
        for row, job in enumerate(self._rows):
            views = row_views(self._cache, row, self._pads[row])
            if row in finished:
                job.kv = [(k.clone(), v.clone()) for k, v in views]
                job.done.set()
            else:
                job.kv = views
                keep.append(job)
        self._rows, self._cache = keep, None


_GUARD = threading.Lock()


def model_batcher(model: Any, lock: threading.RLock) -> Batcher:
    """One batcher per model object, so engines sharing a model decode together."""
    with _GUARD:
        batcher = getattr(model, "_kvboost_batcher", None)
        if batcher is None:
            batcher = Batcher(model, lock)
            model._kvboost_batcher = batcher
        return batcher
