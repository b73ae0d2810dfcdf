"""A ``WarmResult`` agrees with the tiers' own stats (issue 48 rows 2-4): it names a tier
that stored nothing, its ``bytes`` is what the tiers hold after the warm (with a warning
when the warm did not fit them), and blank documents are skipped with a warning on every
route instead of aborting the warm."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from conftest import make_model, make_tokenizer
from redis_server import RedisProcess, free_port

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.core.model.kv import kv_nbytes

# Of one length in tokens each (the test tokenizer: one token per character).
DOCS = [f"Document {i}. It states that item {i} costs {i + 10} dollars." for i in range(6)]


def engine(**config: object) -> KVBoost:
    return KVBoost(make_model("llama"), make_tokenizer(), KVBoostConfig(block_tokens=8, **config))


def held_passages(one: KVBoost, docs: list[str]) -> int:
    """The passages of ``docs`` a request finds stored (used, or recomputed whole)."""
    result = one.generate("Which?", passages=docs, max_new_tokens=1)
    return result.passages_hit + result.passages_unused


# -- row 2: the tier that failed ---------------------------------------------------------


def test_a_warm_into_an_unreachable_redis_says_the_shared_tier_failed() -> None:
    one = engine(remote_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    with pytest.warns(UserWarning, match="unavailable"):
        report = warm_corpus(one, DOCS[:2], progress=False)
    remote = one.stats().remote
    assert remote is not None and remote.writes == 0  # what the tier itself says
    assert report.failed == ("remote",)
    assert report.new == 2 and report.dropped == 0  # still held in memory


def test_a_warm_into_a_running_redis_fails_no_tier(redis_server: RedisProcess) -> None:
    one = engine(remote_url=redis_server.url)
    report = warm_corpus(one, DOCS[:3], progress=False)
    assert report.failed == () and one.stats().remote.writes == 3  # type: ignore[union-attr]


def test_a_cache_dir_that_cannot_hold_a_cache_is_a_failed_disk_tier(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    with pytest.warns(UserWarning, match="cannot hold the cache"):
        one = engine(cache_dir=a_file)
    assert warm_corpus(one, DOCS[:2], progress=False).failed == ("disk",)


# -- row 3: bytes held, and a warm over the budget ---------------------------------------


def unit_bytes(docs: list[str]) -> int:
    """The KV bytes of one passage of ``docs`` (all are the same length in tokens)."""
    one = engine()
    return warm_corpus(one, docs[:1], progress=False).bytes


def test_a_warm_over_the_memory_budget_warns_and_reports_what_is_held() -> None:
    size = unit_bytes(DOCS)
    one = engine(max_cache_bytes=2 * size + size // 2)  # room for two of the six
    with pytest.warns(UserWarning, match=r"4 of the 6 passages .* \(max_cache_bytes="):
        report = warm_corpus(one, DOCS, progress=False)
    memory = one.stats().cache
    assert (report.units, report.new, report.dropped) == (6, 6, 4)
    assert report.bytes == memory.bytes == 2 * size <= memory.max_bytes
    assert held_passages(one, DOCS[-2:]) == 2  # the last two are the ones kept


def test_a_disk_tier_holds_what_memory_cannot(tmp_path: Path) -> None:
    size = unit_bytes(DOCS)
    one = engine(max_cache_bytes=2 * size, cache_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped: no warning
        report = warm_corpus(one, DOCS, progress=False)
    assert (report.dropped, report.failed, report.bytes) == (0, (), 6 * size)
    assert one.stats().disk.entries == 6  # type: ignore[union-attr]


def test_a_prefix_warm_over_the_budget_warns_too() -> None:
    text = " ".join(DOCS)
    whole = engine().warm(text)
    one = engine(max_cache_bytes=whole.bytes // 3)
    with pytest.warns(UserWarning, match=r"of the \d+ prefix blocks .* \(max_cache_bytes="):
        report = one.warm(text)
    assert 0 < report.dropped < report.units
    assert report.bytes == one.stats().cache.bytes < whole.bytes


def test_bytes_counts_a_warm_of_cached_passages_too() -> None:
    one = engine()
    first = warm_corpus(one, DOCS[:3], progress=False)
    again = warm_corpus(one, DOCS[:3], progress=False)
    assert (again.cached, again.new, again.bytes) == (3, 0, first.bytes)
    assert first.bytes == sum(kv_nbytes(e.kv) for e in one._store.memory._entries.values())


# -- row 4: blank documents --------------------------------------------------------------


@pytest.mark.parametrize("blank, what", [("", "empty"), (" \n\t", "only whitespace")])
def test_warm_corpus_skips_a_blank_document_with_a_warning(blank: str, what: str) -> None:
    one = engine()
    with pytest.warns(UserWarning, match=rf"skipping documents\[0\]: it is {what}"):
        report = warm_corpus(one, [blank, DOCS[0]], progress=False)
    assert (report.documents, report.skipped, report.units, report.new) == (2, 1, 1, 1)
    assert held_passages(one, DOCS[:1]) == 1


def test_warm_passages_skips_a_blank_text_with_a_warning() -> None:
    one = engine()
    with pytest.warns(UserWarning, match=r"skipping texts\[1\]: it is empty"):
        report = one.warm_passages([DOCS[0], "", DOCS[1]])
    assert (report.skipped, report.units) == (1, 2)


def test_only_blank_documents_warm_nothing_and_say_so() -> None:
    one = engine()
    with pytest.warns(UserWarning, match="skipping documents"):
        report = warm_corpus(one, ["", "  "], progress=False)
    assert (report.documents, report.skipped, report.units, report.bytes) == (2, 2, 0, 0)
    assert one.stats().cache.entries == 0


def test_the_adapters_skip_a_blank_document_with_the_same_warning() -> None:
    from langchain_core.documents import Document

    from kvboost_rag.integrations.langchain import KVBoostPipeline

    llm = KVBoostPipeline(engine=engine(), max_tokens=1)
    with pytest.warns(UserWarning, match=r"skipping documents\[0\]: it is empty"):
        llm.invoke("Which item?", documents=[Document(""), Document(DOCS[0])])
    assert llm.engine.stats().requests == 1
