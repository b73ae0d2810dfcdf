"""The shared Redis tier, against a real redis-server: sharing between engines, checks on
every read, and faults that never reach the user nor serve wrong KV."""

import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import found, make_model, make_tokenizer
from redis_server import VALUES, RedisProcess, Trickle, free_port
from warm_worker import corpus

from kvboost_rag import GenerationResult, KVBoost, KVBoostConfig
from kvboost_rag.core.store import codec
from kvboost_rag.core.store.keys import digest
from kvboost_rag.core.store.remote import RemoteStore, redact

WORKER = Path(__file__).parents[1] / "warm_worker.py"
DOCS = corpus(6)
QUESTION = "Which code?"


def make_engine(url: str | None, cache_dir: Path | None = None, **config) -> KVBoost:
    config = KVBoostConfig(block_tokens=8, cache_dir=cache_dir, remote_url=url, **config)
    return KVBoost(make_model("llama"), make_tokenizer(), config)


# Read deadline for tests that turn every warning into an error: on a loaded 2-core
# machine one read of ~60 values took over the default 0.5 s and warned of an outage,
# which is not what they check.
SLOW_READS = 10.0


def answer(engine: KVBoost, docs: list[str] = DOCS) -> list[int]:
    return engine.generate(QUESTION, passages=docs, max_new_tokens=6).token_ids


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """The answer with no shared tier at all, the passages warmed in the same engine."""
    engine = make_engine(None)
    engine.warm_passages(DOCS)
    return answer(engine)


@pytest.fixture(scope="module")
def cold() -> list[int]:
    """The answer of a fresh engine with no shared tier (nothing cached)."""
    return answer(make_engine(None))


def same_kv(a: KVBoost, b: KVBoost) -> int:
    """How many entries both engines hold in memory are bit for bit equal; assert that the
    rest differ by rounding only. An entry an engine encoded itself was computed in its own
    batch of passages, and on some CPUs (a 2-core AVX2 EPYC) a matrix product rounds by its
    row count: 2 of 56 such entries differed there, by 1.8e-7."""
    shared = set(a._store.memory._entries) & set(b._store.memory._entries)
    equal = 0
    for key in shared:
        x, y = a._store.memory._entries[key], b._store.memory._entries[key]
        assert x.tokens == y.tokens
        pairs = [(k1, k2) for (k1, v1), (k2, v2) in zip(x.kv, y.kv)]
        pairs += [(v1, v2) for (k1, v1), (k2, v2) in zip(x.kv, y.kv)]
        for p, q in pairs:
            torch.testing.assert_close(p, q, atol=1e-5, rtol=0)
        equal += all(torch.equal(p, q) for p, q in pairs)
    return equal


def test_a_second_engine_serves_the_corpus_from_redis_without_encoding(
    redis_server: RedisProcess, tmp_path: Path, expected: list[int]
) -> None:
    a = make_engine(redis_server.url, tmp_path / "a")
    a.warm_passages(DOCS)
    assert a.stats().remote.writes == len(DOCS)  # type: ignore[union-attr]
    b = make_engine(redis_server.url, tmp_path / "b")
    result = b.generate(QUESTION, passages=DOCS, max_new_tokens=6)
    assert (found(result), result.passages_missed) == (len(DOCS), 0)
    assert result.token_ids == expected  # passage KV from Redis is bit for bit a's
    b._store.flush()
    remote, disk = b.stats().remote, b.stats().disk
    assert remote is not None and disk is not None
    assert remote.hits == len(DOCS) and disk.entries >= len(DOCS)  # promoted to b's disk


def test_exact_prefix_blocks_travel_bit_exact_under_a_lossy_codec(
    redis_server: RedisProcess, tokenizer
) -> None:
    prompt = "A fixed system prompt that many requests share, long enough for blocks."
    a = make_engine(redis_server.url, fidelity="exact", kv_codec="int8")
    a.warm(prompt)
    a._store.flush()
    b = make_engine(redis_server.url, fidelity="exact", kv_codec="int8")
    full = make_engine(None, fidelity="exact")
    got = b.first_token_logits(prompt + " And a question?")
    want = full.first_token_logits(prompt + " And a question?")
    assert b.stats().remote.hits > 0  # type: ignore[union-attr]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_codec", ["int8", "fp8"])
def test_coded_passages_are_half_the_bytes_and_close(
    redis_server: RedisProcess, kv_codec: str
) -> None:
    plain = make_engine(redis_server.url, remote_namespace="plain")
    plain.warm_passages(DOCS)
    coded = make_engine(redis_server.url, remote_namespace="coded", kv_codec=kv_codec)
    coded.warm_passages(DOCS)
    ratio = coded.stats().remote.written_bytes / plain.stats().remote.written_bytes  # type: ignore[union-attr]
    assert ratio < 0.45  # fp32 KV: 1 byte per element instead of 4, plus scales
    # fast: balanced's shared repair recomputes every token of these look-alike passages
    reader = make_engine(
        redis_server.url, remote_namespace="coded", kv_codec=kv_codec, fidelity="fast"
    )
    local = make_engine(None, fidelity="fast")  # the same passages, encoded here, uncoded
    local.warm_passages(DOCS)
    got = reader.first_token_logits(QUESTION, passages=DOCS)
    want = local.first_token_logits(QUESTION, passages=DOCS)
    assert reader.stats().remote.hits == len(DOCS)  # type: ignore[union-attr]
    assert not torch.equal(got, want)  # the codec is lossy...
    assert torch.softmax(got, -1).sub(torch.softmax(want, -1)).abs().sum() < 0.05  # ...and close


def test_damaged_and_foreign_values_are_dropped_and_recomputed(
    redis_server: RedisProcess,
) -> None:
    a = make_engine(redis_server.url)
    a.warm_passages(DOCS)
    client = redis_server.client()
    names = sorted(client.keys(VALUES))
    assert len(names) == len(DOCS)
    first = client.get(names[0])
    client.set(names[0], first[: len(first) // 2])  # truncated
    flipped = bytearray(client.get(names[1]))
    flipped[-7] ^= 0xFF
    client.set(names[1], bytes(flipped))  # one bit off
    client.set(names[2], client.get(names[3]))  # another key's value
    b = make_engine(redis_server.url)
    with pytest.warns(UserWarning, match="dropping damaged shared cache value"):
        result = b.generate(QUESTION, passages=DOCS, max_new_tokens=6)
    assert (found(result), result.passages_missed) == (len(DOCS) - 3, 3)
    assert same_kv(a, b) >= len(DOCS)  # what b holds is what a computed: nothing damaged
    assert b.stats().remote.corrupt == 3  # type: ignore[union-attr]
    b._store.flush()  # the recomputed KV replaced the damaged values
    c = make_engine(redis_server.url)
    assert c.generate(QUESTION, passages=DOCS, max_new_tokens=6).passages_missed == 0


def test_another_models_entries_are_never_served(redis_server: RedisProcess) -> None:
    a = make_engine(redis_server.url)
    a.warm_passages(DOCS)
    other = KVBoost(make_model("llama", seed=1), make_tokenizer(), a.config)
    result = other.generate(QUESTION, passages=DOCS, max_new_tokens=2)
    other.flush()  # its writes of what it encoded reach the server before the server stops
    assert result.passages_missed == len(DOCS)  # another fingerprint: other keys
    assert other.stats().remote.hits == 0  # type: ignore[union-attr]


def test_server_down_at_start_warns_once_and_serves_locally(cold: list[int]) -> None:
    engine = make_engine(f"redis://127.0.0.1:{free_port()}/0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = answer(engine)
        again = answer(engine, DOCS[::-1])
        engine.warm_passages(corpus(9))
    assert first == cold and len(again) == 6
    shared = [w for w in caught if "shared KV tier" in str(w.message)]
    assert len(shared) == 1 and "unavailable" in str(shared[0].message)
    stats = engine.stats().remote
    assert stats is not None and not stats.available and stats.hits == 0


def test_killed_then_restarted_server_is_used_again_after_the_backoff(
    redis_server: RedisProcess, expected: list[int]
) -> None:
    engine = make_engine(redis_server.url)
    engine.warm_passages(DOCS[:3])
    redis_server.kill()
    with pytest.warns(UserWarning, match="unavailable"):
        engine.warm_passages(DOCS[3:])  # killed mid-warm: the rest stays local
        assert answer(engine) == expected
    written = engine.stats().remote.writes  # type: ignore[union-attr]
    redis_server.start()  # restarted, empty, same port
    time.sleep(1.2)  # past the first back-off (0.5 s, then 1 s)
    engine.warm_passages(corpus(8))
    assert engine.stats().remote.writes > written  # type: ignore[union-attr]
    assert engine.stats().remote.available  # type: ignore[union-attr]


def timed_answer(engine: KVBoost, warning: str) -> tuple[GenerationResult, float]:
    """The answer, and its wall time in seconds, with the tier's ``warning`` expected."""
    with pytest.warns(UserWarning, match=warning):
        start = time.perf_counter()
        result = engine.generate(QUESTION, passages=DOCS, max_new_tokens=6)
        return result, time.perf_counter() - start


def test_a_stuck_server_costs_at_most_the_timeout(
    redis_server: RedisProcess, cold: list[int]
) -> None:
    make_engine(redis_server.url).warm_passages(DOCS)
    engine = make_engine(redis_server.url, remote_timeout=0.2)
    redis_server.pause()
    try:
        result, elapsed = timed_answer(engine, "unavailable")
    finally:
        redis_server.resume()
    assert result.token_ids == cold and result.passages_missed == len(DOCS)
    baseline = make_engine(None).generate(QUESTION, passages=DOCS, max_new_tokens=6).total_ms
    assert elapsed < baseline / 1e3 + 2 * 0.2 + 0.5  # one timed-out call, then skipped


def test_a_value_trickling_in_over_a_slow_link_costs_at_most_the_timeout(
    redis_server: RedisProcess, cold: list[int]
) -> None:
    make_engine(redis_server.url).warm_passages(DOCS)
    link = Trickle(redis_server.port, chunk=512, delay=0.05)  # ~10 KiB/s: every read is quick
    try:
        engine = make_engine(link.url, remote_timeout=0.3)
        result, elapsed = timed_answer(engine, "a read took over 0.3 s")
    finally:
        link.close()
    # The first read is abandoned at the timeout and the tier skipped: nothing was found, so
    # the prompt is prefilled here as if nothing were cached.
    assert result.token_ids == cold and result.passages_missed == len(DOCS)
    baseline = make_engine(None).generate(QUESTION, passages=DOCS, max_new_tokens=6).total_ms
    # One abandoned read, then skipped (small answers still cross the link at its pace);
    # waiting for the six ~30 KB values at ~10 KiB/s would take ~18 s.
    assert elapsed < baseline / 1e3 + 0.3 + 1.0


def test_flushed_keys_are_misses(redis_server: RedisProcess, cold: list[int]) -> None:
    make_engine(redis_server.url).warm_passages(DOCS)
    redis_server.client().flushall()
    engine = make_engine(redis_server.url, remote_timeout=SLOW_READS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a vanished key is a miss, nothing more
        result = engine.generate(QUESTION, passages=DOCS, max_new_tokens=6)
        engine.flush()  # its writes reach the server before the server stops
    assert result.token_ids == cold and result.passages_missed == len(DOCS)


def test_out_of_memory_refusals_warn_once(tmp_path: Path, expected) -> None:
    with RedisProcess(tmp_path, "--maxmemory", "1mb", "--maxmemory-policy", "noeviction") as server:
        engine = make_engine(server.url)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.warm_passages(corpus(60))
            assert answer(engine) == expected
            engine.flush()  # its writes are tried before the server stops
        refused = [w for w in caught if "answered an error" in str(w.message)]
        assert len(refused) == 1 and "OutOfMemoryError" in str(refused[0].message)
        stats = engine.stats().remote
        assert stats is not None
        # After a refusal writes pause for a back-off: most values are never sent.
        assert stats.errors < 10 and stats.skipped > 40


def test_keys_the_server_evicts_are_misses_and_nothing_else(tmp_path: Path) -> None:
    with RedisProcess(
        tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"
    ) as server:
        docs = corpus(60)
        writer = make_engine(server.url)
        writer.warm_passages(docs)
        assert len(server.client().keys(VALUES)) < len(docs)  # the server evicted some
        reader = make_engine(server.url, remote_timeout=SLOW_READS)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hits = [
                reader.generate(QUESTION, passages=docs[i : i + 6], max_new_tokens=1)
                for i in range(0, 60, 6)
            ]
            reader.flush()  # its writes reach the server before the server stops
        stored = sum(found(r) for r in hits)
        assert 0 < stored < len(docs) and sum(r.passages_missed for r in hits) == 60 - stored
        assert same_kv(writer, reader) >= stored  # every value read is the writer's, bit for bit


def test_values_over_the_servers_limit_are_skipped(tmp_path: Path) -> None:
    with RedisProcess(tmp_path, "--proto-max-bulk-len", "1mb") as server:
        store = RemoteStore(server.url, b"model")
        big = [(torch.zeros(1, 4, 8192, 16), torch.zeros(1, 4, 8192, 16))]  # 4 MiB
        with pytest.warns(UserWarning, match="over the server's limit"):
            store.put_later(digest(b"big"), (1,), big)
            store.flush()
        store.put_later(digest(b"small"), (1,), [(t[:, :, :8], t[:, :, :8]) for t, _ in big])
        store.flush()
        assert store.stats().writes == 1 and store.stats().skipped == 1


def test_two_processes_warming_one_server_leave_every_entry_valid(
    redis_server: RedisProcess,
) -> None:
    cmd = [sys.executable, str(WORKER), "-", "24", redis_server.url]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    engine = make_engine(redis_server.url)
    client = redis_server.client()
    prefix = f"kvboost:{engine.fingerprint.hex()}:".encode()
    names = client.keys(prefix + b"[0-9a-f]*")  # values, not the catalogue
    assert len(names) >= 24
    for name in names:
        key = bytes.fromhex(name[len(prefix) :].decode())
        codec.from_bytes(client.get(name), key, engine.fingerprint.hex())  # raises if bad


def test_config_errors_are_specific() -> None:
    with pytest.raises(ValueError, match="redis://"):
        KVBoostConfig(remote_url="http://localhost:6379")
    with pytest.raises(ValueError, match="remote_timeout"):
        KVBoostConfig(remote_url="redis://x", remote_timeout=0)
    with pytest.raises(ValueError, match="remote_namespace"):
        KVBoostConfig(remote_namespace="a b")
    with pytest.raises(ValueError, match="kv_codec"):
        KVBoostConfig(kv_codec="int4")
    assert redact("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("rediss://:secret@host/0") == "rediss://:***@host/0"


def test_session_kv_stays_local_and_only_passages_and_exact_blocks_are_shared(
    redis_server: RedisProcess,
) -> None:
    engine = make_engine(redis_server.url)
    engine.warm_passages(DOCS)
    writes = engine.stats().remote.writes  # type: ignore[union-attr]
    engine.generate(QUESTION, passages=DOCS, max_new_tokens=6)  # reuse route: session KV
    engine.flush()
    session = engine._caches.session
    assert session is not None and session._blocks._blocks  # kept locally
    # The prompt's head before the passages (BOS) has no full block: at most its tail goes.
    assert engine.stats().remote.writes - writes <= 1  # type: ignore[union-attr]
    assert len(redis_server.client().keys(VALUES)) <= len(DOCS) + 1
