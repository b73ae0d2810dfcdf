"""What one fault's user saw: every exception that reached the caller (or ended a
background thread), every warning (each one, not once per place), every kvboost log line;
and what was served: requests completed, wrong answers, routes, TTFT, shared-tier counters.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from benchmarks.common.cluster_server import ClusterProcess
from benchmarks.common.redis_server import RedisProcess
from kvboost_rag import GenerationResult, KVBoost, warm_corpus
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.core.store.remote import RemoteStore

if TYPE_CHECKING:
    from benchmarks.faults.lab import Lab

T = TypeVar("T")
COUNTERS = ("hits", "misses", "corrupt", "errors", "skipped", "writes")


@dataclass
class Watch:
    """What one fault's user saw (exceptions, warnings, log lines) and what was served."""

    fault: str
    raised: list[str] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)
    other_warnings: list[str] = field(default_factory=list)
    logged: list[str] = field(default_factory=list)
    attempted: int = 0
    completed: int = 0
    prefilled: int = 0
    wrong: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # one record per answer
    warm_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    engines: list[KVBoost] = field(default_factory=list)
    servers: list[RedisProcess] = field(default_factory=list)

    def attempt(self, what: str, call: Callable[[], T]) -> T | None:
        try:
            return call()
        except Exception as error:  # noqa: BLE001 -- what reaches the caller is measured
            self.raised.append(f"{what}: {type(error).__name__}: {error}")
            return None

    def server(self, lab: Lab, *args: str) -> RedisProcess:
        self.servers.append(RedisProcess(lab.folder, *args).start())
        return self.servers[-1]

    def cluster(self, lab: Lab, replicas: int = 0, *args: str) -> ClusterProcess:
        """A 3-master cluster of the fault's own (its nodes stopped with its servers);
        ``args``: options of every node."""
        folder = Path(tempfile.mkdtemp(prefix="cluster-", dir=lab.folder))  # new node files
        cluster = ClusterProcess(folder, 3, replicas, *args).start()
        self.servers += cluster.nodes
        return cluster

    def engine(self, lab: Lab, url: str) -> KVBoost:
        engine = self.attempt("KVBoost(...)", lambda: lab.engine(url))
        assert engine is not None, "the engine could not be built: see raised"
        self.engines.append(engine)
        return engine

    def warm(self, lab: Lab, engine: KVBoost) -> None:
        start = time.perf_counter()
        self.attempt("warm_corpus", lambda: warm_corpus(engine, lab.texts, progress=False))
        self.warm_s.append(time.perf_counter() - start)

    def request(self, lab: Lab, engine: KVBoost, i: int) -> GenerationResult | None:
        self.attempted += 1
        result = self.attempt(f"request {i}", lambda: lab.ask(engine, i))
        if result is None:
            return None
        self.completed += 1
        self.prefilled += not result.reused_tokens
        want = lab.expected_for(i, result)
        record = {
            "request": i,
            "route": "reuse" if result.reused_tokens else "prefill",
            "passages_hit": result.passages_hit,
            "passages_missed": result.passages_missed,
            "ttft_ms": result.ttft_ms,
            "lookup_ms": result.timings.lookup_ms,
        }
        self.requests.append(record)
        if result.token_ids != want:
            self.wrong.append({**record, "got": result.token_ids, "want": want})
        return result

    def serve(self, lab: Lab, engine: KVBoost, indices: Iterable[int]) -> None:
        for i in indices:
            self.request(lab, engine, i)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def remote(self) -> dict[str, int]:
        """The shared-tier counters, summed over this fault's engines."""
        stats = [e.stats().remote for e in self.engines]
        return {c: sum(getattr(s, c) for s in stats if s is not None) for c in COUNTERS}


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def watching(fault: str) -> Iterator[Watch]:
    """Record every warning (each one, not once per place), kvboost log line and exception
    in a background thread while a fault runs, until its servers run again and its
    engines' queued writes are sent."""
    watch = Watch(fault)
    logger, handler = logging.getLogger("kvboost_rag"), _Lines(watch.logged)
    hook = threading.excepthook
    threading.excepthook = lambda a: watch.raised.append(
        f"thread {a.thread.name if a.thread else '?'}: {a.exc_type.__name__}: {a.exc_value}"
    )
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield watch
            finally:
                _settle(watch)
        for w in caught:
            ours = str(w.message).startswith("kvboost-rag")
            (watch.warned if ours else watch.other_warnings).append(str(w.message))
    finally:
        logger.removeHandler(handler)
        threading.excepthook = hook


def _settle(watch: Watch) -> None:
    for server in watch.servers:
        server.resume()
    for engine in watch.engines:
        watch.attempt("flush", engine.flush)


def close(watch: Watch) -> None:
    """Stop the fault's servers and writer threads (after its stats were read)."""
    for engine in watch.engines:
        remote = engine.inspect.tiers.tier("remote")
        if isinstance(remote, RemoteStore):
            remote.close()
    for server in watch.servers:
        server.kill()
    watch.engines.clear()


def row(watch: Watch, seconds: float) -> dict[str, Any]:
    ttft = [r["ttft_ms"] for r in watch.requests]
    return {
        "fault": watch.fault,
        "raised": watch.raised,
        "warnings": len(watch.warned),
        "warning_texts": list(dict.fromkeys(watch.warned)),  # distinct, first seen first
        "other_warnings": list(dict.fromkeys(watch.other_warnings)),
        "logged": watch.logged,
        "attempted": watch.attempted,
        "completed": watch.completed,
        "wrong": len(watch.wrong),
        "wrong_detail": watch.wrong,
        "prefilled": watch.prefilled,
        "median_ttft_ms": median(ttft) if ttft else None,
        "worst_ttft_ms": max(ttft, default=None),
        "worst_lookup_ms": max((r["lookup_ms"] for r in watch.requests), default=None),
        "warm_s": watch.warm_s,
        "remote": watch.remote(),
        "notes": watch.notes,
        "requests": watch.requests,
        "seconds": seconds,
    }
