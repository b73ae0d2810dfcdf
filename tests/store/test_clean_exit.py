"""A process that exits with disk writes still queued exits cleanly and loses none."""

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from kvboost_rag.core.store import disk
from kvboost_rag.core.store import writer as writer_module
from kvboost_rag.core.store.disk import DiskStore
from kvboost_rag.core.store.keys import digest

WORKER = Path(__file__).parents[1] / "clean_exit_worker.py"
RUNS = 10  # lost writes: every run before the fix; the abort: one run in 4 (user) to 20 (here)
PARALLEL = 2


def _kv() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)) for _ in range(2)]


def test_exit_right_after_a_cold_prompt_is_clean_and_keeps_every_write(tmp_path: Path) -> None:
    prompts = [1 + run % 2 for run in range(RUNS)]  # 3 or 6 passage writes queued at exit
    results = []
    for first in range(0, RUNS, PARALLEL):
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(tmp_path), str(run), str(prompts[run])],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for run in range(first, min(first + PARALLEL, RUNS))
        ]
        results += [(p, *p.communicate(timeout=120)) for p in procs]
    for proc, out, err in results:
        assert proc.returncode == 0, err
        assert "terminate called" not in err and "FATAL" not in err, err
        assert "could not write" not in err, err
        assert out.split()[0] == "3"  # every passage was a miss, so writes were queued
    files = list(tmp_path.glob("*/*/*.safetensors"))
    assert len(files) == 3 * sum(prompts)  # none lost
    store = DiskStore(tmp_path, bytes.fromhex(files[0].parent.parent.name), 10**12)
    assert all(store.get(bytes.fromhex(f.stem), None) is not None for f in files)
    assert store.stats().corrupt == 0


def test_write_failing_at_exit_warns_with_its_path(tmp_path: Path, monkeypatch) -> None:
    store = DiskStore(tmp_path, b"model-a", 10**9)

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "_atomic_write", full_disk)
    store.put_later(digest(b"k"), (1, 2, 3, 4, 5), _kv())
    with pytest.warns(UserWarning, match=rf"could not write {store.path(digest(b'k'))}"):
        disk._close_at_exit(weakref.ref(store))


def test_writes_after_close_are_synchronous(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, b"model-a", 10**9)
    store.put_later(digest(b"a"), (1, 2, 3, 4, 5), _kv())
    store.close()
    assert store.path(digest(b"a")).exists()
    store.put_later(digest(b"b"), (1, 2, 3, 4, 5), _kv())
    assert store.path(digest(b"b")).exists()


def test_idle_writer_ends_and_frees_the_store(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(writer_module, "IDLE_SECONDS", 0.05)
    store = DiskStore(tmp_path, b"model-a", 10**9)
    store.put_later(digest(b"a"), (1, 2, 3, 4, 5), _kv())
    thread = store._writer._thread
    assert thread is not None
    thread.join(timeout=5)
    assert not thread.is_alive() and store._writer._thread is None
    store.put_later(digest(b"b"), (1, 2, 3, 4, 5), _kv())  # a new thread starts
    store.flush()
    assert digest(b"b") in store
    ref = weakref.ref(store)
    store._writer._thread.join(timeout=5)  # type: ignore[union-attr]
    del store, thread
    gc.collect()
    assert ref() is None
