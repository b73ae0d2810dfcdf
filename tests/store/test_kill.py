"""kill -9 at random points of warming and serving: every file the killed process left is
a whole, valid entry (or a temp file nothing reads), and a new engine on the folder
answers exactly as a no-cache engine does. KILL_ROUNDS sets the slow variant's rounds."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_model, make_tokenizer
from fault_worker import DOCS, PREFIXES, answers, config

from kvboost_rag import KVBoost
from kvboost_rag.core.store.disk import DiskStore
from kvboost_rag.core.store.memory import Entry

WORKER = Path(__file__).parents[1] / "fault_worker.py"
ROUNDS = int(os.environ.get("KILL_ROUNDS", "30"))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return answers(KVBoost(make_model("llama"), make_tokenizer(), config(None)))


@pytest.fixture(scope="module")
def passages() -> dict[bytes, Entry]:
    """Every passage the worker warms, encoded one by one in memory, by key."""
    oracle = KVBoost(make_model("llama"), make_tokenizer(), config(None, "balanced", 10**9))
    for prefix in PREFIXES:
        for doc in DOCS:
            oracle.warm_passages([doc], prefix=prefix)
    memory = oracle._store.memory
    return {key: entry for key, entry in memory._entries.items() if entry.approximate}


def check_folder(root: Path, reference, passages: dict[bytes, Entry]) -> dict[str, int]:
    """Every entry file valid, every passage file the oracle's KV, and a new engine's
    answers the no-cache engine's."""
    found = sorted(root.glob("*/*/*.safetensors"))
    compared = 0
    if found:
        store = DiskStore(root, bytes.fromhex(found[0].parent.parent.name), 10**12)
        for path in found:
            key = bytes.fromhex(path.stem)
            entry = store.get(key, None)
            assert entry is not None, f"{path} is not a valid entry"
            if key in passages:
                assert entry.tokens == passages[key].tokens
                for got, want in zip(entry.kv, passages[key].kv):
                    for a, b in zip(got, want):
                        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
                compared += 1
        assert store.stats().corrupt == 0
    served = KVBoost(make_model("llama"), make_tokenizer(), config(root))
    assert answers(served) == reference
    assert served.stats().disk.corrupt == 0
    temps = len(list(root.glob("*/*/.tmp-*")))
    return {
        "files": len(found),
        "passages": compared,
        "hits": served.stats().disk.hits,
        "temps": temps,
    }


def kill_rounds(root: Path, rounds: int, seed: int, reference, passages) -> list[dict]:
    rng = random.Random(seed)
    results = []
    for r in range(rounds):
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "loop", str(root), str(seed * 1000 + r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 2.0))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, err  # alive until killed
        assert "Traceback" not in err, err
        results.append({"actions": len(out.split()), **check_folder(root, reference, passages)})
    return results


def test_kill_during_warming_and_serving(tmp_path: Path, reference, passages) -> None:
    results = kill_rounds(tmp_path, 3, 1, reference, passages)
    print(results)
    assert results[-1]["files"] > 0


@pytest.mark.slow
def test_kill_during_warming_and_serving_many_rounds(tmp_path: Path, reference, passages):
    results = kill_rounds(tmp_path, ROUNDS, 2, reference, passages)
    print(f"{ROUNDS} rounds:", results)
    assert sum(r["passages"] for r in results) > 0 and sum(r["hits"] for r in results) > 0
