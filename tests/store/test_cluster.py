"""The shared tier on a real Redis Cluster (3 masters on loopback ports): keys sharded over
every master, two processes sharing one corpus through it, and a request's lookup in
batches, one round trip per batch and node, on a cluster as on one server."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import found, make_model, make_tokenizer
from redis_server import VALUES, ClusterProcess
from warm_worker import corpus

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.remote_url import parse_cluster_url, redact
from kvboost_rag.core.store.keys import digest
from kvboost_rag.core.store.remote import RemoteStore

WORKER = Path(__file__).parents[1] / "warm_worker.py"
QUESTION = "Which code?"


def make_engine(url: str | None, cache_dir: Path | None = None, **config) -> KVBoost:
    config = KVBoostConfig(block_tokens=8, cache_dir=cache_dir, remote_url=url, **config)
    return KVBoost(make_model("llama"), make_tokenizer(), config)


def warm_in_a_process(url: str, cache_dir: Path, count: int) -> tuple[int, int, int]:
    """Passages, newly encoded and found cached, as a separate process reports them."""
    cmd = [sys.executable, str(WORKER), str(cache_dir), str(count), url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    units, new, cached = map(int, done.stdout.split())
    return units, new, cached


def test_two_processes_share_a_corpus_through_the_cluster_and_its_keys_spread(
    redis_cluster: ClusterProcess, tmp_path: Path
) -> None:
    docs = corpus(24)
    assert warm_in_a_process(redis_cluster.url, tmp_path / "a", 24) == (24, 24, 0)
    per_master = redis_cluster.keys_per_master(VALUES)
    assert len(per_master) == 3 and all(n > 0 for n in per_master.values()), per_master
    assert sum(per_master.values()) >= 24
    # A second process with its own empty folder encodes nothing: every passage is read
    # from the cluster (and kept in its folder).
    assert warm_in_a_process(redis_cluster.url, tmp_path / "b", 24) == (24, 0, 24)
    assert len(list((tmp_path / "b").rglob("*.safetensors"))) >= 24
    # A third engine serves prompts from it, bit for bit as from a local warm.
    reader, local = make_engine(redis_cluster.url, tmp_path / "c"), make_engine(None)
    local.warm_passages(docs[:7])
    got = reader.generate(QUESTION, passages=docs[:7], max_new_tokens=6)
    assert (found(got), got.passages_missed) == (7, 0)
    assert got.token_ids == local.generate(QUESTION, passages=docs[:7], max_new_tokens=6).token_ids


@pytest.mark.parametrize("topology", ["server", "cluster"])
def test_a_seven_passage_lookup_is_one_round_trip_per_cache_and_node(
    topology: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_server" if topology == "server" else "redis_cluster").url
    docs = corpus(14)
    make_engine(url).warm_passages(docs)
    engine = make_engine(url)
    nodes = 1 if topology == "server" else 3
    for batch in (docs[:7], docs[7:]):  # the first also opens the connections
        remote = engine._store.tier("remote")
        assert isinstance(remote, RemoteStore)
        before = remote.stats().round_trips
        lookup = engine._caches.look_up(engine._prompts.text(QUESTION, batch))
        trips = remote.stats().round_trips - before
        assert sum(kv is not None for kv in lookup.passage_kv) == 7
    # The exact prefix chain in one batch, the seven passages in another: a flight per
    # node each, where one round trip per entry took nine (an EXISTS per cache, a GET per
    # passage) and more for every prefix block found.
    assert 2 <= trips <= 2 * nodes


def test_warm_writes_are_pipelined(redis_cluster: ClusterProcess) -> None:
    store = RemoteStore(redis_cluster.url, b"model")
    kv = [(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8))]
    store.put_later(digest(b"first"), (0,) * 4, kv)
    store.flush()  # connections opened, the server's value limit read
    before = store.stats().round_trips
    for i in range(30):
        store.put_later(digest(bytes([i])), (i,) * 4, kv)
    store.flush()
    stats = store.stats()
    assert stats.writes == 31 and stats.errors == 0
    # An EXISTS and a SET per value took 60; a batch takes one flight per node for each.
    assert stats.round_trips - before <= 4 * 2 * 3, stats
    assert sum(redis_cluster.keys_per_master(VALUES).values()) == 31
    found = store.get_many([(digest(bytes([i])), (i,) * 4) for i in range(30)])
    assert all(entry is not None for entry in found)


def test_cluster_urls_are_checked_and_redacted() -> None:
    parsed = parse_cluster_url("redis-cluster://me:s%40cret@10.0.0.1:7000,[::1]:7001")
    assert parsed.nodes == [("10.0.0.1", 7000), ("::1", 7001)]
    assert (parsed.username, parsed.password) == ("me", "s@cret")
    assert redact("redis-cluster://me:secret@a:1,b:2") == "redis-cluster://me:***@a:1,b:2"
    with pytest.raises(ValueError, match="every cluster node needs host:port"):
        KVBoostConfig(remote_url="redis-cluster://10.0.0.1:7000,10.0.0.2")
    with pytest.raises(ValueError, match="only database 0"):
        KVBoostConfig(remote_url="redis-cluster://10.0.0.1:7000/2")
    with pytest.raises(ValueError, match="redis-cluster://host:port"):
        KVBoostConfig(remote_url="cluster://10.0.0.1:7000")
