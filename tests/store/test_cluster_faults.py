"""Faults on a real Redis Cluster never reach the user nor serve wrong KV: a master killed
(with and without a replica to fail over to), a slot migrating (ASK, then MOVED), a node
out of memory. Each request is answered from the local tiers or recomputed, each outage is
one warning, and every value the cluster serves is bit for bit the warming engine's."""

import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import found, make_model, make_tokenizer
from redis_server import VALUES, ClusterProcess, require_binary
from warm_worker import corpus

from kvboost_rag import GenerationResult, KVBoost, KVBoostConfig
from kvboost_rag.core.store.redis_client import import_redis

DOCS = corpus(7)
QUESTION = "Which code?"
WAIT_S = 20.0  # the most a failover and the back-off after it may take to serve again


def make_engine(url: str | None, **config) -> KVBoost:
    # One passage per encoding forward: a passage's KV is then the same bits whether it was
    # warmed or recomputed after a fault (in a padded batch its last bits follow its
    # batch-mates), so an answer can be compared with the reference's on its route.
    config = KVBoostConfig(block_tokens=8, remote_url=url, encode_batch_tokens=1, **config)
    return KVBoost(make_model("llama"), make_tokenizer(), config)


def assert_right(result: GenerationResult, expected: list[int], cold: list[int]) -> None:
    """The reference's answer on the route the request took: passages reused (some of
    them recomputed), or a plain prefill when most were missing."""
    assert result.token_ids == (expected if result.reused_tokens else cold), result


def answer(engine: KVBoost, docs: list[str] = DOCS) -> GenerationResult:
    return engine.generate(QUESTION, passages=docs, max_new_tokens=6)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """The answer with the passages warmed in the same engine, no shared tier."""
    engine = make_engine(None)
    engine.warm_passages(DOCS)
    return answer(engine).token_ids


@pytest.fixture(scope="module")
def cold() -> list[int]:
    """The answer of a fresh engine with no shared tier (nothing cached)."""
    return answer(make_engine(None)).token_ids


def same_kv(a: KVBoost, b: KVBoost) -> int:
    """Assert that every entry both engines hold in memory is bit for bit equal; how many."""
    shared = set(a._store.memory._entries) & set(b._store.memory._entries)
    for key in shared:
        x, y = a._store.memory._entries[key], b._store.memory._entries[key]
        assert x.tokens == y.tokens
        assert all(
            torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(x.kv, y.kv)
        )
    return len(shared)


def tier_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "shared KV tier" in str(w.message)]


def until_served(
    engine: KVBoost, between: Callable[[], object] = lambda: None
) -> list[GenerationResult]:
    """Fresh requests until one finds every passage in the cluster again (bounded);
    ``between`` runs after each request that did not."""
    results: list[GenerationResult] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        results.append(fresh_answer(engine))
        if found(results[-1]) == len(DOCS):
            return results
        between()
        time.sleep(0.2)
    pytest.fail(f"the cluster did not serve again within {WAIT_S:.0f} s: {results[-1]}")


def keys(cluster: ClusterProcess) -> set[bytes]:
    """The engine's keys on the cluster's masters."""
    return {k for n in cluster.primaries() for k in cluster.client(n).keys(VALUES)}


def forget_keys_but(cluster: ClusterProcess, kept: set[bytes]) -> None:
    """Delete the engine's keys not in ``kept`` from the masters that take commands now
    (none are written while the cluster is down)."""
    for node in cluster.primaries():
        client = cluster.client(node)
        try:
            extra = [k for k in client.keys(VALUES) if k not in kept]
            for key in extra:
                client.delete(key)
        except import_redis().RedisError:  # CLUSTERDOWN, or the node just failed
            continue


def fresh_answer(engine: KVBoost) -> GenerationResult:
    """The answer with the engine's memory emptied first: its passages come from the
    cluster (or are recomputed), not from the previous request."""
    engine.clear_cache()
    return answer(engine)


def recording(call: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return tier_warnings(caught)


def test_a_killed_master_without_replica_is_one_warning_then_local_serving(
    redis_cluster: ClusterProcess, cold: list[int], expected: list[int]
) -> None:
    writer = make_engine(redis_cluster.url)
    writer.warm_passages(DOCS)
    engine = make_engine(redis_cluster.url)
    assert found(answer(engine)) == len(DOCS)  # connected, layout known
    engine.clear_cache()
    victim = redis_cluster.primaries()[0]
    victim.kill()
    results: list[GenerationResult] = []
    seen = recording(lambda: results.extend(fresh_answer(engine) for _ in range(4)))
    assert len(seen) == 1 and "unavailable" in seen[0], seen
    assert found(results[0]) < len(DOCS)  # the dead master's passages recomputed
    for result in results:
        assert_right(result, expected, cold)
    assert not engine.stats().remote.available  # type: ignore[union-attr]
    victim.start()  # rejoins with its cluster file, empty: nothing was persisted
    redis_cluster.wait_until(redis_cluster.healthy, "the node to rejoin")
    # Used again after the back-off: what the restarted master lost is encoded again,
    # written through, and read back from the cluster.
    served = until_served(engine)
    assert served[-1].token_ids == expected and engine.stats().remote.available  # type: ignore[union-attr]
    assert same_kv(writer, engine) >= len(DOCS)  # what the cluster served is the warm's


def test_failover_to_a_replica_serves_the_corpus_again_unchanged(
    tmp_path: Path, expected: list[int], cold: list[int]
) -> None:
    require_binary("redis-cli")
    with ClusterProcess(tmp_path, masters=3, replicas=1) as cluster:
        writer = make_engine(cluster.url)
        writer.warm_passages(DOCS)
        writer.flush()
        cluster.wait_until(cluster.synced, "the replicas to catch up")
        engine = make_engine(cluster.url)
        assert answer(engine).token_ids == expected
        corpus_keys = keys(cluster)
        cluster.primaries()[0].kill()  # its replica takes over after cluster-node-timeout

        def forget_own_prefixes() -> None:
            """A request answered by a plain prefill while the master was down stores its
            prompt's blocks; once they reach the cluster, the next requests reuse that
            prefix (and answer ``cold``, rightly) without looking up a passage. Removed, so
            the requests go on asking for the warmed passages."""
            engine.flush()
            forget_keys_but(cluster, corpus_keys)

        results: list[GenerationResult] = []
        seen = recording(lambda: results.extend(until_served(engine, forget_own_prefixes)))
        assert len(seen) <= 1 and all("unavailable" in w for w in seen), seen
        for result in results:
            assert_right(result, expected, cold)
        assert results[-1].token_ids == expected  # every passage read from the cluster
        assert same_kv(writer, engine) >= len(DOCS)
        assert cluster.keys_per_master(VALUES)  # the promoted replica holds its keys
        assert len(cluster.primaries()) == 3


def test_a_manual_failover_is_followed_without_a_warning(
    tmp_path: Path, expected: list[int]
) -> None:
    require_binary("redis-cli")
    with ClusterProcess(tmp_path, masters=3, replicas=1) as cluster:
        writer = make_engine(cluster.url)
        writer.warm_passages(DOCS)
        writer.flush()
        cluster.wait_until(cluster.synced, "the replicas to catch up")
        engine = make_engine(cluster.url)
        assert found(answer(engine)) == len(DOCS)
        for master in cluster.primaries():  # every slot changes hands
            cluster.fail_over(cluster.replica_of(master))
        engine.clear_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # MOVED from a demoted master is followed
            result = answer(engine)
        assert (found(result), result.token_ids) == (len(DOCS), expected)
        assert same_kv(writer, engine) >= len(DOCS)


def test_a_migrating_slot_is_followed_through_ask_and_moved(
    redis_cluster: ClusterProcess, expected: list[int]
) -> None:
    writer = make_engine(redis_cluster.url)
    writer.warm_passages(DOCS)
    engine = make_engine(redis_cluster.url)
    assert found(answer(engine)) == len(DOCS)  # the engine's layout is now stale
    masters = redis_cluster.primaries()
    names = [n for m in masters for n in redis_cluster.client(m).keys(VALUES)]
    sources = {}
    for name, finish in ((names[0], False), (names[-1], True)):
        slot = redis_cluster.slot(name)
        sources[finish] = redis_cluster.owner(slot)
        target = next(m for m in masters if m is not sources[finish])
        assert redis_cluster.start_migrating(slot, target, share=1.0) == [name]  # ASK
        if finish:
            redis_cluster.finish_migrating(slot, target)  # the slot moved: MOVED
    engine.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # redirections are followed, never warned about
        result = answer(engine)
    assert (found(result), result.token_ids) == (len(DOCS), expected)
    assert same_kv(writer, engine) >= len(DOCS)
    assert redirections(redis_cluster, sources[False], "ASK") > 0
    assert redirections(redis_cluster, sources[True], "MOVED") > 0


def redirections(cluster: ClusterProcess, node, kind: str) -> int:
    """How many ``kind`` redirections ``node`` answered (its INFO errorstats)."""
    return int(cluster.client(node).info("errorstats").get(f"errorstat_{kind}", {}).get("count", 0))


def test_a_node_out_of_memory_refuses_writes_with_one_warning(
    redis_cluster: ClusterProcess, expected: list[int], cold: list[int]
) -> None:
    full = redis_cluster.primaries()[0]
    redis_cluster.client(full).config_set("maxmemory", "1mb")
    redis_cluster.client(full).config_set("maxmemory-policy", "noeviction")
    engine = make_engine(redis_cluster.url)
    seen = recording(lambda: engine.warm_passages(corpus(60)))
    assert len(seen) == 1 and "OutOfMemoryError" in seen[0], seen
    stats = engine.stats().remote
    assert stats is not None and stats.writes > 0 and stats.skipped > 0
    per_master = redis_cluster.keys_per_master(VALUES)
    assert sum(per_master.values()) == stats.writes  # what was refused is not there
    reader = make_engine(redis_cluster.url)
    result: list[GenerationResult] = []
    seen = recording(lambda: (result.append(answer(reader)), reader.flush()))
    assert all("OutOfMemoryError" in w for w in seen), seen  # a refused write, never a read
    assert 0 < found(result[0]) < len(DOCS)  # the full master's passages recomputed
    assert_right(result[0], expected, cold)
    assert same_kv(engine, reader) >= found(result[0])


def test_a_cluster_down_at_start_warns_once_and_serves_locally(cold: list[int]) -> None:
    from benchmarks.common.cluster_server import free_ports

    url = "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in free_ports(3))
    engine = make_engine(url)  # the client connects on first use, not here
    results: list[GenerationResult] = []
    seen = recording(lambda: results.extend(fresh_answer(engine) for _ in range(3)))
    assert len(seen) == 1 and "unavailable" in seen[0], seen
    assert all(r.token_ids == cold for r in results)
    assert not engine.stats().remote.available  # type: ignore[union-attr]
