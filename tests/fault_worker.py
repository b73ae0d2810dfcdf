"""Run as a separate process by test_kill.py and test_disk_faults.py, so that a kill, a
crash (SIGBUS) or another user's permissions hit it and not the test process.

    fault_worker.py loop CACHE_DIR SEED     warm and serve at random until killed
    fault_worker.py answer CACHE_DIR        answer PROMPTS, print token ids and disk stats
    fault_worker.py race FOLDER SECONDS     read entries while a thread damages their files
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from conftest import make_model, make_tokenizer  # noqa: E402
from warm_worker import corpus  # noqa: E402

from kvboost_rag import KVBoost, KVBoostConfig  # noqa: E402
from kvboost_rag.core.reuse import policy  # noqa: E402
from kvboost_rag.core.store.disk import DiskStore  # noqa: E402
from kvboost_rag.core.store.keys import digest  # noqa: E402

policy.SHORT_PASSAGE = 0  # their passages are a few words, reused as in the tests (conftest.py)

DOCS = corpus(12)
PREFIXES = (None, "Answer from these notes.\n")
# A small memory budget, so that requests spill prefix blocks to disk and read them back.
MEMORY_BYTES = 100_000
DISK_BYTES = 250_000  # the loop's: its writes evict older files
PROMPTS = [
    ("Which code?", DOCS[0:3]),
    ("Which code is largest?", [DOCS[4], DOCS[1], DOCS[7]]),
    ("Answer from these notes.\nName the code.", DOCS[8:12]),
]


def config(
    cache_dir: str | Path | None,
    fidelity: str = "exact",
    memory: int = MEMORY_BYTES,
    disk: int = 10 * 2**20,
) -> KVBoostConfig:
    """ "exact" (prefix blocks only) by default: its answers equal a no-cache engine's
    token for token whatever the cache holds, so any wrong KV served shows. A reused
    passage's answer differs from a cold one's by design (the repair approximates)."""
    return KVBoostConfig(
        fidelity=fidelity,  # type: ignore[arg-type]
        block_tokens=8,
        prefix_fallback="encode",  # a passage is never served from another prefix's variant
        cache_dir=cache_dir,
        max_cache_bytes=memory,
        max_disk_bytes=disk,
    )


def answers(engine: KVBoost) -> list[list[int]]:
    """Greedy token ids for each of PROMPTS."""
    return [
        engine.generate(question, passages=docs, max_new_tokens=4).token_ids
        for question, docs in PROMPTS
    ]


def loop(cache_dir: str, seed: int) -> None:
    rng = random.Random(seed)
    engine = KVBoost(
        make_model("llama"), make_tokenizer(), config(cache_dir, "balanced", disk=DISK_BYTES)
    )
    print("ready", flush=True)
    while True:
        docs = rng.sample(DOCS, rng.randint(1, 4))
        action = rng.choice(("warm", "serve", "serve", "flush"))
        if action == "warm":
            engine.warm_passages(docs, prefix=rng.choice(PREFIXES))
        elif action == "serve":  # half the time a prompt the checking engine asks too
            question, docs = rng.choice(PROMPTS) if rng.random() < 0.5 else ("Which?", docs)
            engine.generate(question, passages=docs, max_new_tokens=4)
        else:
            engine.flush()
        print(action, flush=True)


def answer(cache_dir: str) -> None:
    engine = KVBoost(make_model("llama"), make_tokenizer(), config(cache_dir))
    ids = answers(engine)
    disk = engine.stats().disk
    assert disk is not None
    print(json.dumps({"answers": ids, "hits": disk.hits, "corrupt": disk.corrupt}))


def _entries(count: int) -> list[tuple[bytes, tuple[int, ...], list]]:
    torch.manual_seed(0)
    return [
        (digest(bytes([i])), (i,) * 6, [(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))])
        for i in range(count)
    ]


def _damage(store: DiskStore, blobs: list[bytes], stop: threading.Event, seed: int) -> None:
    """Truncate in place, write garbage in place, or swap in another entry's bytes or
    file, then put the right bytes back (in place, as a careless tool would)."""
    rng = random.Random(seed)
    while not stop.is_set():
        i = rng.randrange(len(blobs))
        path, kind = store.path(digest(bytes([i]))), rng.randrange(4)
        try:
            if kind == 0:
                os.truncate(path, rng.randrange(len(blobs[i])))
            elif kind == 1:
                with open(path, "r+b") as f:
                    f.seek(rng.randrange(len(blobs[i])))
                    f.write(os.urandom(64))
            elif kind == 2:
                path.write_bytes(blobs[(i + 1) % len(blobs)])
            else:
                other = path.with_name(".swap")
                other.write_bytes(blobs[(i + 1) % len(blobs)])
                os.replace(other, path)
        except FileNotFoundError:  # the reader removed it as damaged: put it back below
            pass
        time.sleep(rng.random() * 0.002)
        path.write_bytes(blobs[i])


def race(folder: str, seconds: float) -> None:
    warnings.simplefilter("ignore")  # one "removing damaged cache file" per damaged read
    entries = _entries(8)
    store = DiskStore(folder, b"race", 10**9)
    for key, tokens, kv in entries:
        store.put(key, tokens, kv)
    blobs = [store.path(key).read_bytes() for key, _, _ in entries]
    stop = threading.Event()
    damager = threading.Thread(target=_damage, args=(store, blobs, stop, 0))
    damager.start()
    served = missed = wrong = 0
    deadline = time.time() + seconds
    while time.time() < deadline:
        key, tokens, kv = random.choice(entries)
        entry = store.get(key, tokens)
        if entry is None:
            missed += 1
            continue
        served += 1
        same = all(torch.equal(a, b) for pair, got in zip(kv, entry.kv) for a, b in zip(pair, got))
        wrong += not same
    stop.set()
    damager.join()
    print(json.dumps({"served": served, "missed": missed, "wrong": wrong}))


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the tests do: the shared 2-core machine
    mode = sys.argv[1]
    if mode == "loop":
        loop(sys.argv[2], int(sys.argv[3]))
    elif mode == "answer":
        answer(sys.argv[2])
    else:
        assert mode == "race", mode
        race(sys.argv[2], float(sys.argv[3]))
