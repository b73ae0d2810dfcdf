"""The passage catalogues: records read incrementally from a disk tier's file and from the
shared tier's list, whole or not at all, by any process sharing them; an engine that never
warmed a corpus finds it in unmarked prompts once another engine warmed it into Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import found, make_model, make_tokenizer

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.core.store.catalogue import Catalogue, SharedCatalogue, parse, record
from kvboost_rag.core.store.remote import RemoteStore

A, B, C = (tuple(range(k, k + 30)) for k in (100, 200, 300))
TEXTS = [
    f"Note {i}: item {i} is a widget assembled in {city}; it costs {i * 3} dollars, weighs "
    f"{i + 2} kilograms and ships within {i + 4} days from the northern warehouse."
    for i, city in enumerate(["Lyon", "Osaka", "Quito", "Perth"])
]


def test_a_record_being_written_is_read_once_whole() -> None:
    whole = record(A) + record(B)
    found, done = parse(whole[:-7])  # B's last bytes not written yet
    assert (found, done) == ([A], len(record(A)))
    assert parse(whole[done:]) == ([B], len(record(B)))


def test_a_record_cut_short_or_damaged_is_skipped_and_the_rest_read() -> None:
    damaged = bytearray(record(B))
    damaged[-1] ^= 0xFF
    data = record(A)[:-5] + bytes(damaged) + record(C)  # a killed writer's, then damage
    assert parse(data) == ([C], len(data))


def test_a_disk_catalogue_tells_each_reader_what_is_new(tmp_path: Path) -> None:
    writer, reader = Catalogue(tmp_path), Catalogue(tmp_path)  # two processes, one folder
    writer.add(A)
    assert reader.read_new() == [A]
    assert reader.read_new() == []
    writer.add(B)
    writer.add(C)
    assert reader.read_new() == [B, C]
    assert Catalogue(tmp_path).read_new() == [A, B, C]  # a later process reads it all


@pytest.mark.parametrize("topology", ["server", "cluster"])
def test_a_shared_catalogue_tells_every_replica_what_any_stored(
    request: pytest.FixtureRequest, topology: str
) -> None:
    url = request.getfixturevalue("redis_server" if topology == "server" else "redis_cluster").url
    one, other = (RemoteStore(url, b"model", timeout=10.0) for _ in range(2))
    mine, theirs = SharedCatalogue(one), SharedCatalogue(other)
    mine.add(A)
    mine.add(B)
    one.flush()
    assert theirs.read_new() == [A, B] and theirs.read_new() == []
    assert SharedCatalogue(RemoteStore(url, b"another model")).read_new() == []
    other._link.pipeline("delete", [other._catalogue])  # evicted by the server
    mine.add(C)
    one.flush()
    assert theirs.read_new() == [C]  # read again from its start
    for tokens in (A, B, C, A):
        mine.add(tokens)
    one.flush()
    paging = SharedCatalogue(other)
    paging.PAGE = 2  # read in pages of 2 records
    assert paging.read_new() == [C, A, B, C, A]


def test_a_shared_catalogue_out_of_reach_reads_nothing_and_raises_nothing() -> None:
    from redis_server import free_port

    with pytest.warns(UserWarning, match="shared KV tier"):
        down = RemoteStore(f"redis://127.0.0.1:{free_port()}", b"model", timeout=0.2)
        catalogue = SharedCatalogue(down)
        catalogue.add(A)
        down.flush()
        assert catalogue.read_new() == []


def test_an_engine_finds_unmarked_passages_another_engine_warmed_into_redis(
    redis_server,  # type: ignore[no-untyped-def]
) -> None:
    """Two replicas, no disk tier: the second never warmed the corpus, yet its first
    unmarked prompt finds both passages it holds and reads their KV from Redis."""
    config = KVBoostConfig(fidelity="balanced", remote_url=redis_server.url)
    first = KVBoost(make_model("llama"), make_tokenizer(), config)
    warm_corpus(first, TEXTS, progress=False)
    first.flush()
    second = KVBoost(make_model("llama"), make_tokenizer(), config)
    prompt = f"Facts: {TEXTS[2]}\n{TEXTS[0]}\nWhich costs 6?"
    result = second.generate(prompt, max_new_tokens=1)
    assert (found(result), result.passages_missed) == (2, 0)
    second.flush()  # its own writes land before the server stops
    assert second.stats().remote.hits == 2  # type: ignore[union-attr]
