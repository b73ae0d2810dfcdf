"""warm_corpus(): what is warmed is exactly what later prompts contain."""

import subprocess
import sys
from dataclasses import dataclass

import pytest
from conftest import make_model

from kvboost_rag import (
    ContextWindowError,
    KVBoost,
    KVBoostConfig,
    MarkerError,
    format_passages,
    passage,
    warm_corpus,
)
from kvboost_rag.warm import chat_prefix


@dataclass
class LangChainLikeDocument:  # the attribute LangChain's Document carries
    page_content: str


class LlamaIndexLikeNode:  # the method LlamaIndex nodes and documents carry
    def __init__(self, text: str) -> None:
        self._text = text

    def get_content(self) -> str:
        return self._text


class Holder:  # how the framework adapters expose their engine
    def __init__(self, engine: KVBoost) -> None:
        self.engine = engine


DOCS = [f"Document {i}. It states that item {i} costs {i * 3} dollars." for i in range(5)]


@pytest.fixture
def engine(tokenizer) -> KVBoost:
    return KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8))


def test_warmed_documents_are_hits_in_later_prompts(engine: KVBoost) -> None:
    docs = [DOCS[0], LangChainLikeDocument(DOCS[1]), LlamaIndexLikeNode(DOCS[2])]
    report = warm_corpus(Holder(engine), docs, progress=False)
    assert (report.documents, report.units, report.new, report.cached) == (3, 3, 3, 0)
    assert report.tokens > 0 and report.bytes > 0 and report.tokens_per_s > 0
    result = engine.generate("Which item?", passages=DOCS[2::-1], max_new_tokens=2)
    assert (result.passages_hit + result.passages_unused, result.passages_missed) == (3, 0)  # found
    again = warm_corpus(engine, DOCS, batch_size=2, progress=False)
    assert (again.cached, again.new) == (3, 2)


def test_long_documents_split_like_prompts(tokenizer) -> None:
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(max_passage_tokens=60))
    long_doc = " ".join(DOCS)
    report = warm_corpus(engine, [long_doc], progress=False)
    assert report.units > 1
    result = engine.generate("Which item?", passages=[long_doc], max_new_tokens=2)
    assert (result.passages_hit + result.passages_unused, result.passages_missed) == (
        report.units,
        0,
    )


def test_bad_targets_and_documents(engine: KVBoost) -> None:
    with pytest.raises(TypeError, match="expected a KVBoost engine"):
        warm_corpus(object(), DOCS)
    with pytest.raises(TypeError, match=r"documents\[1\] \(3\) is a int: pass strings"):
        warm_corpus(engine, ["ok", 3])
    # Split into pieces of max_passage_tokens (512), which with BOS do not fit the window.
    with pytest.raises(ContextWindowError, match=r"documents\[0\] \('xxx.*is 513 tokens"):
        warm_corpus(engine, ["x" * 600], progress=False)


@dataclass
class SourcedDocument:  # LangChain's Document: an id and metadata["source"]
    page_content: object
    metadata: dict
    id: str | None = None


# Each document the corpus cannot hold: the error names it (index, id, source, the start
# of its text) and says why and what to do, before anything is encoded.
REJECTED = [
    (3, TypeError, r"documents\[2\] \(3\) is a int: pass strings, LangChain"),
    (b"raw", TypeError, r"documents\[2\] \(b'raw'\) is a bytes: decode it to a str first"),
    (
        "bad \udcff byte",
        ValueError,
        r"\('bad \\udcff byte'\) is not valid Unicode: charac"
        r"ter 4 is a lone surrogate .* read the file with its real encoding",
    ),
    (passage("nested"), MarkerError, r"cannot be a passage: .* contains a passage marker"),
    (
        SourcedDocument(None, {"source": "b.pdf"}),  # page_content not text: no content
        TypeError,
        r"documents\[2\] \(source 'b.pdf', SourcedDocument\(page_content=None.*\) is a",
    ),
    (
        "Short. " + "y" * 600,
        ContextWindowError,
        r"documents\[2\] \('Short. yyy.*\.\.\.'\): its longest piece \(512 tokens\) after "
        r"the 1-token prefix is 513 tokens .* set KVBoostConfig\(max_passage_tokens=\) below 511",
    ),
]


@pytest.mark.parametrize("document, error, message", REJECTED)
def test_a_rejected_document_is_named_with_the_reason(
    engine: KVBoost, document: object, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        warm_corpus(engine, [DOCS[0], DOCS[1], document], progress=False)
    assert engine.stats().cache.entries == 0  # rejected before anything was encoded


def test_a_skipped_blank_document_is_named_like_a_rejected_one(engine: KVBoost) -> None:
    """Blank documents are skipped with a warning (tests/reuse/test_warm_report.py), which
    names them as errors do."""
    blank = SourcedDocument("", {"source": "notes/a.txt"}, id="doc-7")
    named = r"skipping documents\[2\] \(id 'doc-7', source 'notes/a.txt'\): it is empty"
    with pytest.warns(UserWarning, match=named):
        report = warm_corpus(engine, [DOCS[0], DOCS[1], blank], progress=False)
    assert (report.skipped, report.units) == (1, 2)


def test_a_llamaindex_file_is_named_by_its_file_name(engine: KVBoost) -> None:
    node = LlamaIndexLikeNode("z" * 700)
    node.metadata = {"file_name": "big.txt"}  # type: ignore[attr-defined]
    node.id_ = "node-1"  # type: ignore[attr-defined]
    with pytest.raises(ContextWindowError, match=r"\(id 'node-1', file_name 'big.txt', 'zzz"):
        warm_corpus(engine, [node], progress=False)


def test_too_long_after_the_prefix_names_the_document(engine: KVBoost) -> None:
    prefix = "Answer from these.\n" * 20  # 380 tokens: DOCS[0] fits alone, not after it
    long = "Fact. " + "w" * 200
    warm_corpus(engine, [long], progress=False)
    with pytest.raises(ContextWindowError, match=r"documents\[1\] \('Fact. www.*after the"):
        warm_corpus(engine, [DOCS[0], long], prefix=prefix, progress=False)


def test_warm_passages_names_a_text_by_its_index(engine: KVBoost) -> None:
    with pytest.raises(ContextWindowError, match=r"texts\[1\]: its longest piece \(512 tokens"):
        engine.warm_passages(["fine", "x" * 600])


def test_a_quiet_warm_leaves_no_thread_behind(engine: KVBoost) -> None:
    """No progress bar's monitor thread; the model's executor ends once idle."""
    code = (
        "import sys, threading, time; sys.path.insert(0, 'tests'); from conftest import "
        "make_model, make_tokenizer; from kvboost_rag import KVBoost, warm_corpus; "
        "from kvboost_rag.core.generation import executor; executor.IDLE_SECONDS = 0.1; "
        "e = KVBoost(make_model('llama'), make_tokenizer()); "
        "warm_corpus(e, ['Some text.'], progress=False); time.sleep(1.0); "
        "assert threading.active_count() == 1, threading.enumerate()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# -- the prefix passages are encoded after ---------------------------------------------


def reuse(result) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    return result.passages_hit, result.passages_foreign, result.passages_missed


@pytest.fixture
def keeping(tokenizer) -> KVBoost:
    """An engine whose repair keeps most of each passage (a fixed 15%): passages used."""
    config = KVBoostConfig(block_tokens=8, repair="deviation", recompute_ratio=0.15)
    return KVBoost(make_model("llama"), tokenizer, config)


def test_a_prompt_prefix_is_reused_exactly(keeping: KVBoost) -> None:
    engine = keeping
    prompt = "Answer from these.\n" + format_passages(DOCS[:3]) + "Which item?"
    warm_corpus(engine, DOCS, prefix=prompt, progress=False)
    again = "Answer from these.\n" + format_passages(DOCS[2::-1]) + "Which costs 6?"
    assert reuse(engine.generate(again, max_new_tokens=2)) == (3, 0, 0)
    # The prefix text alone (no marker) is the same prefix.
    assert engine.passage_prefix("Answer from these.\n") == engine.passage_prefix(prompt)


def test_a_chat_prefix_is_reused_exactly_and_none_is_foreign(keeping: KVBoost) -> None:
    engine = keeping
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": format_passages(DOCS[:2]) + "Which item?"},
    ]
    warm_corpus(engine, DOCS[:2], progress=False)  # no prefix: the generic variant
    assert reuse(engine.chat(messages, max_new_tokens=2)) == (2, 2, 0)
    engine.clear_cache()
    warm_corpus(engine, DOCS[:2], prefix=chat_prefix("Be brief."), progress=False)
    assert reuse(engine.chat(messages, max_new_tokens=2)) == (2, 0, 0)


def passage_tokens(engine: KVBoost, docs: list[str]) -> int:
    return sum(map(len, engine._prompts.passages(docs)))


HEAD = "Answer from these notes, and say which one you used.\n"


def ask(engine: KVBoost, layout: str, question: str):  # type: ignore[no-untyped-def]
    passages = format_passages(DOCS[2::-1])
    if layout == "prompt":
        return engine.generate(HEAD + passages + question, max_new_tokens=1)
    messages = [
        {"role": "system", "content": HEAD},
        {"role": "user", "content": passages + question},
    ]
    return engine.chat(messages, max_new_tokens=1)


@pytest.mark.parametrize("layout", ["prompt", "chat"])
def test_the_first_request_after_warming_a_prefix_reuses_its_head(tokenizer, layout: str) -> None:
    """warm_corpus(prefix=) warmed the passages but not the head before them: the first
    request recomputed it (36 of 124 tokens reused, 90 from the second on)."""
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(fidelity="fast"))
    prefix = HEAD if layout == "prompt" else chat_prefix(HEAD)
    warm_corpus(engine, DOCS[:3], prefix=prefix, progress=False)
    first = ask(engine, layout, "Which item?")
    second = ask(engine, layout, "Which costs 6?")
    assert reuse(first) == (3, 0, 0)
    head_tokens = len(engine.passage_prefix(prefix))
    assert first.reused_tokens >= head_tokens + passage_tokens(engine, DOCS[:3])
    assert first.reused_tokens == second.reused_tokens


def test_warm_reports_count_what_the_cache_holds(tokenizer) -> None:
    """Duplicates were counted once per copy: new=5 and 576,000 bytes for a cache that
    held 2 entries of 230,400 bytes."""
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8))
    docs = ["The sky is blue."] * 4 + ["Grass is green."]
    report = warm_corpus(engine, docs, progress=False)
    held = engine.stats().cache
    assert (report.documents, report.units, report.new, report.cached) == (5, 2, 2, 0)
    assert (held.entries, held.bytes) == (report.units, report.bytes)
    assert report.tokens == passage_tokens(engine, docs[3:])
    again = warm_corpus(engine, docs, progress=False)
    assert (again.units, again.new, again.cached, again.bytes) == (2, 0, 2, report.bytes)
    # A prefix: 21 tokens in blocks of 8 are 2 full blocks and a tail, all 3 stored.
    text = engine.warm("x" * 20)
    assert (text.units, text.new, text.cached) == (3, 3, 0)
    assert engine.stats().cache.entries == 2 + 3


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True, "2"])
def test_batch_size_must_be_a_positive_int(engine: KVBoost, batch_size: object) -> None:
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1 .* got"):
        warm_corpus(engine, DOCS, batch_size=batch_size, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        engine.warm_passages(DOCS, batch_size=batch_size)  # type: ignore[arg-type]
    assert engine.stats().cache.entries == 0


@pytest.mark.parametrize("blank", ["", "  \n\t"])
def test_a_blank_text_is_skipped_by_warm_passages_too(engine: KVBoost, blank: str) -> None:
    """warm_corpus refused it; engine.warm_passages warmed nothing and said nothing (found
    by the whitespace property in tests/api/test_fuzz_api.py). Both skip it and say so
    now (issue 48), as the CLI skips a blank file."""
    with pytest.warns(UserWarning, match=r"skipping texts\[1\]: it is (empty|only whitespace)"):
        report = engine.warm_passages(["Fine text.", blank])
    assert (report.skipped, report.units) == (1, 1)


def test_a_prefix_over_the_context_window_is_refused(engine: KVBoost) -> None:
    """With no document to measure against, a 600-token head was warmed on a 512-token
    model now that the head itself is warmed."""
    with pytest.raises(ContextWindowError, match="the prefix is 600 tokens"):
        warm_corpus(engine, [], prefix="x" * 600, progress=False)
    assert engine.stats().cache.entries == 0


def test_one_string_is_not_a_corpus(engine: KVBoost) -> None:
    """It was read one character at a time ("documents[4] is only whitespace")."""
    with pytest.raises(TypeError, match="documents is a str, not a collection of documents"):
        warm_corpus(engine, "The sky is blue.")


def test_the_progress_bar_counts_passages(engine: KVBoost, capsys) -> None:
    warm_corpus(engine, DOCS[:2])
    err = capsys.readouterr().err
    assert "encoding: 2 passages" in err and "0passage" not in err


def test_unknown_prefixes_get_specific_errors(engine: KVBoost) -> None:
    with pytest.raises(TypeError, match="prefix is a int: pass None, a prompt string"):
        warm_corpus(engine, DOCS, prefix=3)
    with pytest.raises(ValueError):  # messages that do not mark where the passages go
        warm_corpus(engine, DOCS, prefix=[{"role": "user", "content": "no marker"}])


def test_warm_imports_no_framework_for_plain_prefixes() -> None:
    check = (
        "import sys; from kvboost_rag.warm import resolve_prefix; "
        "assert resolve_prefix('Docs:', None) == 'Docs:'; "
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('langchain_core', "
        "'llama_index')]; assert not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
