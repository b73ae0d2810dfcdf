"""The disk tier: persistence, corruption, foreign files, budgets, several processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import found, make_model
from warm_worker import corpus

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.store.disk import DiskStore
from kvboost_rag.core.store.keys import digest

WORKER = Path(__file__).parents[1] / "warm_worker.py"
KEY = digest(b"k")


def kv(dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.randn(1, 2, 5, 4).to(dtype), torch.randn(1, 2, 5, 4).to(dtype)) for _ in range(3)
    ]


def test_roundtrip_preserves_dtype_and_values(tmp_path: Path) -> None:
    store, data = DiskStore(tmp_path, b"model-a", 10**9), kv()
    store.put(KEY, (1, 2, 3, 4, 5), data)
    entry = store.get(KEY, (1, 2, 3, 4, 5))
    assert entry is not None and entry.kv[0][0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(entry.kv, data))
    assert store.get(KEY, (9, 9, 9, 9, 9)) is None  # token ids are compared on every hit


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_is_detected_removed_and_missed(tmp_path: Path, damage: str) -> None:
    store = DiskStore(tmp_path, b"model-a", 10**9)
    store.put(KEY, (1, 2, 3, 4, 5), kv())
    path = store.path(KEY)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="removing damaged cache file"):
        assert store.get(KEY, None) is None
    assert not path.exists() and store.stats().corrupt == 1


def test_foreign_model_file_is_never_served(tmp_path: Path) -> None:
    other = DiskStore(tmp_path, b"model-b", 10**9)
    other.put(KEY, (1, 2, 3, 4, 5), kv())
    mine = DiskStore(tmp_path, b"model-a", 10**9)
    assert mine.get(KEY, None) is None  # another folder
    mine.path(KEY).parent.mkdir(parents=True, exist_ok=True)
    mine.path(KEY).write_bytes(other.path(KEY).read_bytes())  # copied in by hand
    with pytest.warns(UserWarning, match="fingerprint does not match"):
        assert mine.get(KEY, None) is None


def test_budget_removes_least_recently_used(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, b"model-a", 10**9)
    keys = [digest(bytes([i])) for i in range(3)]
    for i, key in enumerate(keys):
        store.put(key, (i,) * 5, kv())
        time.sleep(0.01)
    size = store.path(keys[0]).stat().st_size
    store.get(keys[0], None)  # keys[0] is now the most recently used
    store.max_bytes = 2 * size
    store.put(digest(b"new"), (7,) * 5, kv())
    assert keys[0] in store and keys[1] not in store
    assert store.stats().bytes <= 2 * size


def _folder_bytes(store: DiskStore) -> int:  # os.walk: the test below patches Path.glob
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(store.dir)
        for f in files
        if f.endswith(".safetensors")
    )


def test_budget_holds_over_many_writes_without_listing_the_folder(
    tmp_path: Path, monkeypatch
) -> None:
    store = DiskStore(tmp_path, b"model-a", 10**9)
    store.put(KEY, (0,) * 5, kv())
    size = store.path(KEY).stat().st_size
    store.max_bytes = 5 * size
    globs = []
    monkeypatch.setattr(Path, "glob", lambda self, pattern: globs.append(pattern) or iter(()))
    for i in range(40):
        store.put(digest(bytes([i])), (i,) * 5, kv())
        assert store.get(KEY, None) is not None  # read every time: never the one evicted
        stats = store.stats()
        assert stats.entries == min(i + 2, 5)
        assert _folder_bytes(store) == stats.bytes <= store.max_bytes
    monkeypatch.undo()
    assert not globs  # neither writes nor stats() listed the folder
    assert KEY in store and digest(bytes([39])) in store and digest(bytes([30])) not in store


def test_second_store_on_the_folder_sees_the_first_ones_files(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, b"model-a", 10**9)
    keys = [digest(bytes([i])) for i in range(4)]
    for i, key in enumerate(keys):
        first.put(key, (i,) * 5, kv())
        time.sleep(0.01)  # distinct mtimes: the second store orders by them
    second = DiskStore(tmp_path, b"model-a", 10**9)
    assert (second.stats().entries, second.stats().bytes) == (4, _folder_bytes(first))
    second.max_bytes = second.stats().bytes  # one more file is one too many
    second.put(digest(b"new"), (9,) * 5, kv())
    assert keys[0] not in second and all(key in second for key in keys[1:])


def test_a_file_evicted_while_it_is_read_is_not_counted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that loses its file to another thread's eviction serves what it read and
    leaves the budget's count alone (it counted that file again, above the budget, in a
    mixed workload of CI's); a file another process wrote counts once read."""
    from kvboost_rag.core.store import disk

    store = DiskStore(tmp_path, b"model-a", 10**9)
    store.put(KEY, (1, 2, 3, 4, 5), kv())
    touch = disk._touch

    def evicted_meanwhile(path: Path) -> None:
        with store._lock:  # as _enforce_budget evicts, on another thread
            store._index.removed(path)
            path.unlink()
        touch(path)

    monkeypatch.setattr(disk, "_touch", evicted_meanwhile)
    assert store.get(KEY, (1, 2, 3, 4, 5)) is not None
    assert (store.stats().entries, store.stats().bytes) == (0, 0) == (0, _folder_bytes(store))
    monkeypatch.setattr(disk, "_touch", touch)
    other = DiskStore(tmp_path, b"model-a", 10**9)
    other.put(KEY, (1, 2, 3, 4, 5), kv())  # another process's file, unknown to store
    assert store.get(KEY, (1, 2, 3, 4, 5)) is not None
    assert store.stats().bytes == _folder_bytes(store) > 0


def test_files_removed_by_another_process_are_tolerated(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, b"model-a", 10**9)
    keys = [digest(bytes([i])) for i in range(6)]
    for i, key in enumerate(keys):
        store.put(key, (i,) * 5, kv())
    size = store.path(keys[0]).stat().st_size
    for key in keys[:3]:  # another process evicts or cleans up behind this store's back
        store.path(key).unlink()
    assert store.get(keys[0], None) is None
    store.max_bytes = 2 * size
    store.put(digest(b"new"), (9,) * 5, kv())  # the oldest it would evict is gone: rescan
    assert _folder_bytes(store) == store.stats().bytes <= 2 * size
    assert digest(b"new") in store and keys[5] in store and keys[4] not in store


def test_new_engine_serves_passages_from_disk(tmp_path: Path, tokenizer) -> None:
    config = KVBoostConfig(block_tokens=8, cache_dir=tmp_path)
    first = KVBoost(make_model("llama"), tokenizer, config)
    docs = corpus(4)
    assert first.warm_passages(docs).new == 4
    second = KVBoost(make_model("llama"), tokenizer, config)  # a restart: empty memory
    result = second.generate("Which code?", passages=docs[::-1], max_new_tokens=2)
    assert (found(result), result.passages_missed) == (4, 0)
    assert second.stats().disk.hits == 4
    torch.testing.assert_close(
        second.first_token_logits("Which code?", passages=docs),
        first.first_token_logits("Which code?", passages=docs),
        atol=1e-6,
        rtol=0,
    )


def test_damaged_entry_is_recomputed_by_the_engine(tmp_path: Path, tokenizer) -> None:
    config = KVBoostConfig(block_tokens=8, cache_dir=tmp_path)
    KVBoost(make_model("llama"), tokenizer, config).warm_passages(corpus(2))
    for path in tmp_path.glob("*/*/*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    engine = KVBoost(make_model("llama"), tokenizer, config)
    with pytest.warns(UserWarning, match="removing damaged cache file"):
        again = engine.warm_passages(corpus(2))
    assert (again.cached, again.new) == (0, 2)
    assert KVBoost(make_model("llama"), tokenizer, config).warm_passages(corpus(2)).cached == 2


def _valid_entries(root: Path) -> int:
    store = DiskStore(root, bytes.fromhex(next(root.iterdir()).name), 10**12)
    files = list(root.glob("*/*/*.safetensors"))
    for path in files:
        entry = store.get(bytes.fromhex(path.stem), None)
        assert entry is not None, f"{path} is not a valid entry"
    return len(files)


def test_kill_during_warming_leaves_nothing_corrupt(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), "3000"])
    deadline = time.time() + 60
    while len(list(tmp_path.glob("*/*/*.safetensors"))) < 20 and time.time() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert proc.returncode != 0  # it was killed mid-way, not finished
    written = _valid_entries(tmp_path)
    assert 0 < written < 3000
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "60"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split()[0] == "60"
    assert "damaged" not in done.stderr


def test_two_processes_warming_one_folder_both_succeed(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path), "80"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("damaged" not in err for _, err in outputs)
    assert _valid_entries(tmp_path) == 80
