"""warm_corpus(): what is warmed is exactly what later prompts contain."""

from dataclasses import dataclass

import pytest
from conftest import make_model

from kvboost_rag import ContextWindowError, KVBoost, KVBoostConfig, warm_corpus


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
    assert (result.passages_hit, result.passages_missed) == (3, 0)
    again = warm_corpus(engine, DOCS, batch_size=2, progress=False)
    assert (again.cached, again.new) == (3, 2)


def test_long_documents_split_like_prompts(tokenizer) -> None:
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(max_passage_tokens=60))
    long_doc = " ".join(DOCS)
    report = warm_corpus(engine, [long_doc], progress=False)
    assert report.units > 1
    result = engine.generate("Which item?", passages=[long_doc], max_new_tokens=2)
    assert (result.passages_hit, result.passages_missed) == (report.units, 0)


def test_bad_targets_and_documents(engine: KVBoost) -> None:
    with pytest.raises(TypeError, match="expected a KVBoost engine"):
        warm_corpus(object(), DOCS)
    with pytest.raises(TypeError, match=r"documents\[1\] is a int"):
        warm_corpus(engine, ["ok", 3])
    with pytest.raises(ValueError, match=r"documents\[0\] is empty"):
        warm_corpus(engine, [""])
    with pytest.raises(ContextWindowError, match="a passage is .* tokens"):
        warm_corpus(engine, ["x" * 600], progress=False)
