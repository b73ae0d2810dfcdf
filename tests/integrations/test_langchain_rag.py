"""A real LangChain retrieval chain over essay chunks, on the embedded SmolLM2: a second
question that retrieves the same chunks in another order reads their KV from the cache."""

from __future__ import annotations

import pytest
from langchain_core.vectorstores import InMemoryVectorStore

from benchmarks.rag.langchain_rag import (
    essay_documents,
    minilm_embeddings,
    passage_tokens,
    reordered_pair,
    retrieval_chain,
)
from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.integrations.langchain import ChatKVBoost

pytestmark = pytest.mark.embedded


@pytest.fixture(scope="module")
def retriever(embedded: KVBoost):
    docs = essay_documents(embedded, chunks=10, chunk_tokens=96)
    store = InMemoryVectorStore.from_documents(docs, minilm_embeddings())
    return store.as_retriever(search_kwargs={"k": 3})


@pytest.mark.parametrize("fidelity", ["fast", "balanced"])
def test_reordered_retrieval_reads_passages_from_cache(
    embedded: KVBoost, retriever, fidelity: str
) -> None:
    pair = next(
        p
        for d in retriever.vectorstore.store.values()
        if (p := reordered_pair(retriever, "What does this say: " + d["text"][:80]))
    )
    first, second, texts = pair
    engine = KVBoost(embedded.model, embedded.tokenizer, KVBoostConfig(fidelity=fidelity))
    chain = retrieval_chain(ChatKVBoost(engine=engine, max_tokens=4), retriever)
    chain.invoke({"input": first})
    before = engine.stats()
    answer = chain.invoke({"input": second})
    after = engine.stats()
    assert sorted(d.page_content for d in answer["context"]) == sorted(texts)
    reused = after.reused_tokens - before.reused_tokens
    passages = passage_tokens(engine, texts)
    # "fast" reads every passage token; "balanced" recomputes ~30% of them on purpose.
    assert reused >= (passages if fidelity == "fast" else 0.6 * passages)


def test_warm_corpus_accepts_the_chat_model_and_its_documents(embedded: KVBoost) -> None:
    engine = KVBoost(embedded.model, embedded.tokenizer, KVBoostConfig(fidelity="fast"))
    chat = ChatKVBoost(engine=engine, max_tokens=4)
    docs = essay_documents(engine, chunks=4, chunk_tokens=96)
    report = warm_corpus(chat, docs, progress=False)
    assert (report.documents, report.new) == (4, 4)
    result = chat.invoke("Summarize.", documents=docs[::-1])
    assert result.response_metadata["passages_hit"] == 4
