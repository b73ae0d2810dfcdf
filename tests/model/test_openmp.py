"""Freeing a thread's OpenMP pool (``core/model/openmp.py``): the pool of the calling thread
goes (its worker threads end), the libgomp asked is the one torch binds to even where other
wheels loaded their own copies, and the serving loop's callers, the engine's constructor
and the background writers free theirs while the loop's thread keeps its own."""

from __future__ import annotations

import ctypes
import glob
import os
import site
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model import openmp
from kvboost_rag.core.store import writer as writer_module

needs_libgomp = pytest.mark.skipif(
    openmp._libgomp() is None or torch.get_num_threads() < 2,
    reason="torch runs no GNU OpenMP pool of 2+ threads here",
)


_POOL_PROBE = """
import os, sys, threading, time
import torch
from kvboost_rag.core.model import openmp

def threads():
    return len(os.listdir("/proc/self/task"))

def settled(want):  # workers end asynchronously
    deadline = time.monotonic() + 5.0
    while threads() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

counts = {}

def body():
    counts["before"] = threads()
    torch.softmax(torch.randn(64, 4096), dim=-1)  # parallel: this thread's pool
    counts["pooled"] = threads()
    counts["freed"] = openmp.release_pool()
    counts["released"] = settled(counts["before"])
    torch.softmax(torch.randn(64, 4096), dim=-1)
    counts["again"] = threads()

thread = threading.Thread(target=body)
thread.start()
thread.join()
print(torch.get_num_threads() - 1, counts["before"], counts["pooled"], counts["freed"],
      counts["released"], counts["again"])
"""


@needs_libgomp
def test_the_calling_threads_pool_is_freed_and_made_again_on_use() -> None:
    """Counted in a process of its own: in the test process other tests' threads (loops,
    writers, servers) may start or end while the count is taken."""
    probe = subprocess.run(
        [sys.executable, "-c", _POOL_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    assert probe.returncode == 0, probe.stderr
    workers, before, pooled, freed, released, again = probe.stdout.split()
    assert freed == "True"
    assert int(pooled) == int(before) + int(workers)
    assert int(released) == int(before)
    assert int(again) == int(pooled)


@needs_libgomp
def test_the_libgomp_asked_is_torchs_with_other_copies_loaded() -> None:
    others = [
        path
        for root in site.getsitepackages()
        for path in glob.glob(os.path.join(root, "*.libs", "libgomp*.so*"))
    ]
    if not others:
        pytest.skip("no other wheel brings a libgomp here")
    for path in others:
        ctypes.CDLL(path)  # mapped beside torch's, as importing that wheel would
    openmp._libgomp.cache_clear()
    torch_dir = os.path.dirname(torch.__file__)
    defined_in = os.path.realpath(openmp._defined_in(openmp._libgomp()))
    assert defined_in.startswith(os.path.realpath(torch_dir))


def test_threads_that_leave_the_forwards_to_the_loop_free_their_pools(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The constructing thread frees its pool; a caller frees its pool after it last ran
    the loop (it waited, or led and handed over); the background thread never frees its
    own (it ends with the thread); the indexer frees its pool after storing answers."""
    events: list[tuple[str, str]] = []

    def record(event: str) -> None:
        events.append((threading.current_thread().name, event))

    monkeypatch.setattr(openmp, "release_pool", lambda: record("free") or True)
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8))
    assert events == [(threading.current_thread().name, "free")]
    executor = engine._handle.executor
    turn = executor._run_turn
    monkeypatch.setattr(executor, "_run_turn", lambda: record("turn") or turn())
    go = threading.Barrier(3)

    def ask(i: int) -> None:
        go.wait()
        engine.generate(f"Report {i}: which depot ships the crates?", max_new_tokens=12)

    callers = [threading.Thread(target=ask, args=(i,), name=f"caller-{i}") for i in range(2)]
    for caller in callers:
        caller.start()
    go.wait()
    for caller in callers:
        caller.join()
    engine._caches.indexer.join()
    for name in ("caller-0", "caller-1"):
        mine = [event for thread, event in events if thread == name]
        assert mine and mine[-1] == "free", (name, mine)
    assert any(event == "turn" for _, event in events)
    assert ("kvboost-executor", "free") not in events
    assert ("kvboost-indexer", "free") in events


def test_a_writer_frees_its_pool_after_each_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    freed: list[str] = []
    monkeypatch.setattr(
        openmp, "release_pool", lambda: freed.append(threading.current_thread().name) or True
    )
    applied: list[int] = []
    writer = writer_module.Writer("kvboost-test-writer", applied.append)
    for item in range(3):
        writer.submit(item)
    writer.join()
    writer.close()
    assert applied == [0, 1, 2]
    assert freed and set(freed) == {"kvboost-test-writer"}


def test_a_blocking_batch_frees_its_callers_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The integrations' ``batch`` runs each call on a worker thread while the caller only
    waits: the caller frees its pool first (a lone call runs on the caller, which keeps it)."""
    from kvboost_rag.integrations._common import concurrently

    freed: list[str] = []
    monkeypatch.setattr(
        openmp, "release_pool", lambda: freed.append(threading.current_thread().name) or True
    )
    assert concurrently(lambda x: x * 2, [1]) == [2] and freed == []
    assert concurrently(lambda x: x * 2, [1, 2, 3]) == [2, 4, 6]
    assert freed == [threading.current_thread().name]
