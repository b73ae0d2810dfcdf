"""Disk faults: a full disk, a read-only folder, unreadable files, the folder removed while
running, files damaged while read, a cache_dir that cannot hold a cache (a folder warmed
by another model: ``test_foreign_folders.py``). Each one is at most a warning: requests go
on from memory, and every answer equals a no-cache engine's (greedy, fp32, identical
tokens)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer
from disk_setup import assert_all_valid, engine, files, warmed
from fault_worker import DOCS, answers, config

from kvboost_rag import KVBoost
from kvboost_rag.core.store import disk
from kvboost_rag.core.store.disk import DiskStore
from kvboost_rag.core.store.keys import digest
from kvboost_rag.core.store.tiers import TieredStore

WORKER = Path(__file__).parents[1] / "fault_worker.py"
NOBODY = 65534


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return answers(KVBoost(make_model("llama"), make_tokenizer(), config(None)))


# -- a full disk ------------------------------------------------------------------------


def no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class HalfWrite:
    """A file whose write stops half-way with ENOSPC, as on a disk that fills up."""

    def __init__(self, f) -> None:  # type: ignore[no-untyped-def]
        self._f = f

    def write(self, data: bytes) -> int:
        self._f.write(data[: len(data) // 2])
        no_space()
        return 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._f, name)

    def __enter__(self) -> HalfWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def inject_full_disk(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    if where == "create":  # no inode or block left for the temp file
        monkeypatch.setattr(tempfile, "mkstemp", no_space)
    elif where == "write":
        real = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda *a, **k: HalfWrite(real(*a, **k)))
    elif where == "fsync":  # delayed allocation: the error shows when the data is synced
        monkeypatch.setattr(os, "fsync", no_space)
    else:
        assert where == "replace"
        monkeypatch.setattr(os, "replace", no_space)


@pytest.mark.parametrize("where", ["create", "write", "fsync", "replace"])
def test_full_disk_fails_no_request_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference, where: str
) -> None:
    served = engine(tmp_path)
    inject_full_disk(monkeypatch, where)
    with pytest.warns(UserWarning, match="No space left on device; its KV is kept in memory"):
        assert answers(served) == reference  # spills and passage writes all fail
    with pytest.raises(OSError, match=r"could not write .* \(and \d+ more\)"):
        served.flush()
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]  # not even a temp
    monkeypatch.undo()  # space again: writes go on
    assert answers(served) == reference
    served.flush()
    restarted = engine(tmp_path)
    assert answers(restarted) == reference and restarted.stats().disk.hits > 0


def test_a_failed_spill_does_not_fail_the_request(tmp_path: Path, monkeypatch) -> None:
    """Memory evictions were written to disk in the request's thread, and a full disk
    raised out of the request that evicted."""
    kv = [(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))]
    store = TieredStore(500, [DiskStore(tmp_path, b"model-a", 10**9)])  # room for one entry
    monkeypatch.setattr(disk, "_atomic_write", no_space)
    store.put(digest(b"a"), (1,) * 5, kv)
    with pytest.warns(UserWarning, match="could not write"):
        store.put(digest(b"b"), (2,) * 5, kv)  # evicts "a": its spill fails
    assert store.get(digest(b"b"), None) is not None
    with pytest.raises(OSError, match="No space left"):
        store.flush()
    store.flush()  # reported once


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 160 KiB file system (five passages' entries), where the host lets us mount."""
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(folder)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (a full disk is injected above)")
    try:
        yield folder
    finally:
        # Lazily: a failed test's engine may still hold a file open there.
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def test_a_real_full_disk(small_tmpfs: Path, reference) -> None:
    filling = engine(small_tmpfs)
    with pytest.warns(UserWarning, match="No space left"):
        assert answers(filling) == reference
    with pytest.raises(OSError, match="No space left"):
        filling.flush()
    assert assert_all_valid(small_tmpfs) > 0 and not files(small_tmpfs, ".tmp-*")
    served = engine(small_tmpfs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # its own writes fail too, or not
        assert answers(served) == reference
    assert served.stats().disk.hits > 0


# -- permissions --------------------------------------------------------------------------


def test_unreadable_files_are_missed_kept_and_warned(tmp_path: Path, monkeypatch, reference):
    warmed(tmp_path)
    before = files(tmp_path)

    def denied(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(disk, "open", denied, raising=False)  # disk.py's reads only
    served = engine(tmp_path)
    with pytest.warns(UserWarning, match="cannot read cache file .* Permission denied"):
        assert answers(served) == reference
    stats = served.stats().disk
    assert (stats.hits, stats.corrupt) == (0, 0) and set(before) <= set(files(tmp_path))


def test_files_of_another_user_are_served(tmp_path: Path, monkeypatch, reference) -> None:
    """A read touches the file (its eviction order); on a file another user owns that
    raised PermissionError out of every disk hit."""
    warmed(tmp_path)

    def not_owner(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "utime", not_owner)
    served = engine(tmp_path)
    assert answers(served) == reference
    assert served.stats().disk.hits > 0


def _as_reader(folder: Path) -> dict:  # type: ignore[type-arg]
    """Run the answer worker on ``folder`` with permission bits in force: when we are root
    (whom they do not stop), as root without its capabilities, the files another user's."""
    command = [sys.executable, str(WORKER), "answer", str(folder)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root needs setpriv (util-linux) to drop its capabilities")
        command = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--", *command]
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout), "stderr": done.stderr}


def test_read_only_folder_with_unreadable_and_damaged_files(tmp_path: Path, reference) -> None:
    shared_folder = tmp_path / "cache"
    entries = files(warmed(shared_folder))
    # Of each eight files one unreadable, one damaged, one gone (so there are writes to
    # try), all read-only. The first block (every prompt's) stays: a chain is read up to
    # its first bad block.
    for i, path in enumerate(entries):
        if i % 8 == 6:
            path.unlink()
            continue
        if i % 8 == 3:
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        path.chmod(0 if i % 8 == 1 else 0o444)
    for path in [shared_folder, *shared_folder.rglob("*")]:
        if path.is_dir():
            path.chmod(0o555)
    try:
        result = _as_reader(shared_folder)
    finally:
        for path in [shared_folder, *shared_folder.rglob("*")]:
            path.chmod(0o755)
    assert result["answers"] == reference
    assert result["hits"] > 0, result
    met = [m in result["stderr"] for m in ("cannot read cache file", "cannot remove (")]
    assert any(met) and "could not write" in result["stderr"], result["stderr"]
    assert files(shared_folder) == [p for i, p in enumerate(entries) if i % 8 != 6]


# -- the folder removed while running -----------------------------------------------------


def test_cache_folder_removed_between_requests(tmp_path: Path, reference) -> None:
    """Writes made the file's subfolder only, so once the model's folder was removed every
    write failed (and a memory eviction's raised out of the request)."""
    served = engine(warmed(tmp_path))
    shutil.rmtree(tmp_path)
    assert answers(served) == reference
    served.flush()  # no write failed: the folder was made again
    assert assert_all_valid(tmp_path) > 0
    assert answers(engine(tmp_path)) == reference


def test_cache_folder_removed_again_and_again_while_serving(tmp_path: Path, reference) -> None:
    served = engine(tmp_path)
    stop = threading.Event()

    def remove() -> None:
        while not stop.wait(0.01):
            shutil.rmtree(tmp_path, ignore_errors=True)

    remover = threading.Thread(target=remove)
    remover.start()
    try:
        for _ in range(3):
            assert answers(served) == reference
    finally:
        stop.set()
        remover.join()
    try:
        served.flush()
    except OSError as error:  # a write whose folder went between mkdir and the temp file
        assert "No such file or directory" in str(error)
    assert_all_valid(tmp_path)


# -- files damaged while read --------------------------------------------------------------


def test_files_damaged_while_read_are_never_served(tmp_path: Path) -> None:
    """Entries were memory-mapped, and a file truncated in place while mapped killed the
    reader with SIGBUS. The worker reads while a thread truncates, overwrites or swaps the
    files under it."""
    done = subprocess.run(
        [sys.executable, str(WORKER), "race", str(tmp_path), "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    counts = json.loads(done.stdout)
    assert counts["wrong"] == 0 and counts["served"] > 0 and counts["missed"] > 0, counts


@pytest.mark.parametrize("damage", ["truncate", "swap", "garbage"])
def test_replaced_files_are_recomputed(tmp_path: Path, reference, damage: str) -> None:
    entries = files(warmed(tmp_path))
    blobs = [path.read_bytes() for path in entries]
    for i, path in enumerate(entries):
        if damage == "truncate":
            path.write_bytes(blobs[i][: len(blobs[i]) * i // len(entries)])
        elif damage == "swap":  # each file holds the next entry's bytes
            path.write_bytes(blobs[(i + 1) % len(blobs)])
        else:
            path.write_bytes(os.urandom(len(blobs[i])))
    served = engine(tmp_path)
    with pytest.warns(UserWarning, match="removing damaged cache file"):
        assert answers(served) == reference
    assert served.stats().disk.hits == 0 and served.stats().disk.corrupt > 0


# -- a cache_dir that cannot hold a cache ---------------------------------------------------


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_unusable_cache_dir_is_said_once_and_kept_in_memory(tmp_path: Path, where: str) -> None:
    """The engine warned "kept in memory until it is", every request warned again per file,
    warm_corpus raised OSError and the exit said the KV "was not cached"."""
    from kvboost_rag import warm_corpus

    a_file = tmp_path / "cache"
    a_file.write_text("not a folder")
    cache_dir = a_file if where == "a file" else a_file / "kv"
    in_memory = engine(None, fidelity="fast")  # what no cache_dir does
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = engine(cache_dir, fidelity="fast")
        assert answers(served) == answers(in_memory)
        report = warm_corpus(served, DOCS, progress=False)  # memory only, as said
        assert answers(served) == answers(in_memory)
        served.flush()
    # The one about the folder (the warm over this small memory budget is warned apart)
    messages = [str(w.message) for w in caught if "cannot hold the cache" in str(w.message)]
    assert len(messages) == 1, messages
    assert f"cache_dir '{cache_dir}' cannot hold the cache (Not a directory)" in messages[0]
    assert "the disk tier is off: KV is kept in memory only" in messages[0]
    assert served.stats().disk is None and report.units == len(DOCS)
    assert a_file.read_text() == "not a folder"
