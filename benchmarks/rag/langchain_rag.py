"""A LangChain retrieval chain over the essay corpus, side by side with the
``HuggingFacePipeline`` / ``ChatHuggingFace`` it replaces.

    python -m benchmarks.rag.langchain_rag [--pairs 3] [--k 4] [--chunk-tokens 200]

The essays are split by ``KVBoostTextSplitter`` and embedded with the offline MiniLM
(``HuggingFaceEmbeddings``) into an ``InMemoryVectorStore``. Each ChatKVBoost level that
reuses passages first warms every chunk for the chain's prompt (``warm_corpus(chat, docs,
prefix=rag_prompt())``, not timed). For each pair, a first question retrieves k chunks; a
second question, found among the chunks' own sentences, retrieves the same chunks in another
order. Every system answers both through the same ``create_retrieval_chain``; TTFT is wall
time from ``chain.stream`` to the first answer token (retrieval included). All systems share
one model object, dtype and thread count.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

import torch

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common.baseline import write_report
from kvboost_rag.bench.common.corpus import QUESTION_PREFIX
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive
from kvboost_rag.cli.rag_setup import (
    answer_stats,
    essay_documents,
    hf_chat_model,
    minilm_embeddings,
    rag_prompt,
    retrieval_chain,
    stream_first_token,
)


def reordered_pair(retriever: Any, seed_question: str) -> tuple[str, str, list[str]] | None:
    """A second question retrieving the same chunks as ``seed_question`` in another order."""
    first = retriever.invoke(seed_question)
    ids = [d.page_content for d in first]
    for doc in first[1:]:
        for sentence in re.split(r"(?<=[.!?])\s+", doc.page_content):
            if len(sentence) < 40:
                continue
            second = [d.page_content for d in retriever.invoke(QUESTION_PREFIX + sentence)]
            if sorted(second) == sorted(ids) and second != ids:
                return seed_question, QUESTION_PREFIX + sentence, ids
    return None


def systems(engine: KVBoost, max_tokens: int) -> dict[str, Any]:
    """The HF pipeline baseline and ChatKVBoost at each fidelity, all on one model."""
    from kvboost_rag.integrations.langchain import ChatKVBoost

    out: dict[str, Any] = {"HuggingFacePipeline (full prefill)": hf_chat_model(engine, max_tokens)}
    for level in ("exact", "balanced", "fast"):
        kv = KVBoost(engine.model, engine.tokenizer, KVBoostConfig(fidelity=level))
        out[f"ChatKVBoost {level}"] = ChatKVBoost(engine=kv, max_tokens=max_tokens)
    return out


def passage_tokens(engine: KVBoost, texts: list[str]) -> int:
    from kvboost_rag import format_passages

    return sum(len(engine.tokenize(format_passages([t]))) for t in texts)


def reuses_passages(llm: Any) -> bool:
    """ChatKVBoost at a level with passage reuse (not the HF baseline, not ``exact``)."""
    kv = getattr(llm, "engine", None)
    return kv is not None and kv.config.fidelity != "exact"


def warm_for_chain(llm: Any, docs: list[Any]) -> float | None:
    """Seconds to warm every chunk for the chain's prompt; None where nothing is warmed."""
    if not reuses_passages(llm):
        return None
    return warm_corpus(llm, docs, prefix=rag_prompt(), progress=False).seconds


def measure(
    llm: Any, retriever: Any, pairs: list[tuple[str, str, list[str]]], engine: KVBoost
) -> dict[str, list[float]]:
    """Both questions of each pair through the chain; for ours, what the second one's
    request reused and where its passages came from."""
    chain = retrieval_chain(llm, retriever)
    kv, stats = getattr(llm, "engine", None), answer_stats()
    row: dict[str, list[float]] = {
        k: [] for k in ("first_ttft", "second_ttft", "cache_read", "prompt_share")
    }
    row.update(passages_foreign=[], passages_missed=[])
    for first, second, texts in pairs:
        row["first_ttft"].append(stream_first_token(chain, first)[0])
        if kv is None:
            row["second_ttft"].append(stream_first_token(chain, second)[0])
            continue
        before = kv.stats()
        row["second_ttft"].append(stream_first_token(chain, second, callbacks=[stats])[0])
        after = kv.stats()  # what the second question's one request reused
        reused = after.reused_tokens - before.reused_tokens
        row["cache_read"].append(reused / passage_tokens(engine, texts))
        row["prompt_share"].append(reused / (after.prompt_tokens - before.prompt_tokens))
        if reuses_passages(llm):
            row["passages_foreign"].append(stats.stats["passages_foreign"])
            row["passages_missed"].append(stats.stats["passages_missed"])
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from langchain_core.vectorstores import InMemoryVectorStore

    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    docs = essay_documents(engine, args.chunks, args.chunk_tokens)
    store = InMemoryVectorStore.from_documents(docs, minilm_embeddings())
    retriever = store.as_retriever(search_kwargs={"k": args.k})
    seeds = [
        QUESTION_PREFIX + d.page_content.split(".")[0] for d in docs[:: max(1, len(docs) // 12)]
    ]
    pairs = [p for p in map(lambda q: reordered_pair(retriever, q), seeds) if p][: args.pairs]
    rows: dict[str, dict[str, Any]] = {}
    for name, llm in systems(engine, args.max_tokens).items():
        warm_s = warm_for_chain(llm, docs)
        rows[name] = {"warm_s": warm_s, **measure(llm, retriever, pairs, engine)}
        print(f"{name}: done" + (f" (warmed in {warm_s:.1f} s)" if warm_s else ""))
    return {
        "model": args.model,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "chunks": len(docs),
        "k": args.k,
        "warmed": True,
        "pairs": [{"first": a, "second": b} for a, b, _ in pairs],
        "systems": rows,
    }


def table(report: dict[str, Any]) -> str:
    """The report as a markdown table (printed by a run, pasted into the README)."""
    systems = report["systems"]
    base = statistics.median(systems["HuggingFacePipeline (full prefill)"]["second_ttft"])
    warmed = "chunks warmed for the chain's prompt" if report.get("warmed") else "nothing warmed"
    lines = [
        f"{report['chunks']} essay chunks ({warmed}), k={report['k']}, "
        f"{len(report['pairs'])} reordered question pairs, {report['dtype']}, "
        f"{report['threads']} threads, median TTFT",
        "",
        "| system | 1st question TTFT ms | 2nd (same chunks, new order) TTFT ms | speed-up "
        "| cache_read / passage tokens | cache_read / prompt tokens "
        "| 2nd: passages foreign / missed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in systems.items():
        second = statistics.median(row["second_ttft"])
        read = [
            f"{100 * statistics.median(row[k]):.0f}%" if row[k] else "-"
            for k in ("cache_read", "prompt_share")
        ]
        lines.append(
            f"| {name} | {statistics.median(row['first_ttft']):.0f} | {second:.0f} "
            f"| {base / second:.2f}x | {read[0]} | {read[1]} | {_sources(row)} |"
        )
    return "\n".join(lines)


def _sources(row: dict[str, Any]) -> str:
    """Second questions' passages reused under another prefix / encoded, summed over pairs."""
    if not row.get("passages_foreign"):
        return "-"
    return f"{sum(row['passages_foreign'])} / {sum(row['passages_missed'])}"


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.rag.langchain_rag", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default=None, type=dtype_name, help="float32 or bfloat16 (default: auto)"
    )
    parser.add_argument("--chunks", type=positive, default=60)
    parser.add_argument("--chunk-tokens", type=positive, default=200)
    parser.add_argument("--k", type=positive, default=4)
    parser.add_argument("--pairs", type=positive, default=3)
    parser.add_argument("--max-tokens", type=positive, default=16)
    parser.add_argument("--out", type=Path, default=Path("docs/bench"))
    parser.add_argument("--show", type=Path, help="print the table of a saved JSON and exit")
    args = parser.parse_args(argv)
    if args.show:
        print(table(json.loads(args.show.read_text())))
        return
    report = run(args)
    print(table(report))
    write_report(args.out, f"langchain-{report['dtype']}.json", report)


if __name__ == "__main__":
    main()
