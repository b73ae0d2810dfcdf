"""Concurrent RAG requests on one model: batched engine vs serialized vs HuggingFacePipeline.

    python -m kvboost_rag.bench.load [--levels 1,2,4,8,16] [--rounds 1] [--k 3]
        [--max-new-tokens 48] [--dtype float32] [--threads N] [--out DIR] [--quick]

Essay passages (``bench.corpus.passages``, ~``--chunk-tokens`` tokens each) are warmed with
``warm_corpus`` for the requests' layout (``rag_setup``'s system message, then the passages,
then the question from the user); each engine warms its own cache (not timed). A request
is a distinct question plus ``--k`` passages drawn from the corpus, greedy, at most
``--max-new-tokens`` tokens. At each level N, N requests start together (threads released
by a barrier), ``--rounds`` times with new questions, on every system in turn:

- batched: ``KVBoost.stream_chat`` with the default ``max_batch_size``;
- serialized: the same with ``max_batch_size=1`` (one request at a time under a lock);
- HuggingFacePipeline: LangChain's ``llm.batch`` of the chat-templated prompts with
  ``batch_size=N`` (full prefill of every prompt, left padded; it cannot stream a batch, so
  its TTFT is its time to last token).

TTFT is wall time from the call to the first streamed text delta, TTLT to the end;
aggregate tokens/s and requests/s divide by the time from the first start to the last end.
Every system runs on one loaded model with one torch thread count; one untimed request per
system comes first. Prints the table and writes ``load-<dtype>[-<weights>].json`` / ``.txt`` /
``.png``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import time
from typing import Any

from kvboost_rag import KVBoost, KVBoostConfig, format_passages, warm_corpus
from kvboost_rag.bench.common.corpus import QUESTION_PREFIX, passages
from kvboost_rag.bench.common.runs import parse_common, run_and_write
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.bench.common.transcript import note
from kvboost_rag.bench.load.report import SERIAL, draw, summarize, table
from kvboost_rag.bench.load.systems import (
    Messages,
    System,
    batch_before,
    batch_delta,
    engine_system,
    pipeline_system,
    same,
)
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive
from kvboost_rag.cli.rag_setup import SYSTEM

QUICK = {"levels": "1,2", "max_new_tokens": 8, "passages": 8, "chunk_tokens": 96, "k": 2}


def rag_messages(texts: list[str], question: str) -> Messages:
    """``rag_setup.rag_prompt``'s layout with the passages marked for reuse."""
    return [
        {"role": "system", "content": SYSTEM + format_passages(texts)},
        {"role": "user", "content": question},
    ]


def rag_requests(texts: list[str], k: int, count: int, seed: int) -> list[Messages]:
    """``count`` requests, each ``k`` passages and a question no other request asks (a
    sentence of its first passage)."""
    rng, asked, out = random.Random(seed), set[str](), list[Messages]()
    for _ in range(100 * count):
        if len(out) == count:
            return out
        docs = rng.sample(texts, k)
        fresh = [s for s in re.split(r"(?<=[.!?])\s+", docs[0]) if len(s) >= 40]
        fresh = [s for s in fresh if s not in asked]
        if fresh:
            asked.add(sentence := rng.choice(fresh))
            out.append(rag_messages(docs, QUESTION_PREFIX + sentence))
    raise ValueError(f"the corpus has too few distinct sentences for {count} requests")


def build(base: KVBoost, args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    """The three systems on ``base``'s model, the engines warmed (each its own cache)."""
    systems: dict[str, System] = {}
    warm: dict[str, Any] = {}
    prefix = rag_messages(["passage"], "question")
    for name, size in (("batched", None), ("serialized", 1)):
        config = KVBoostConfig(fidelity=args.fidelity, max_batch_size=size)
        engine = KVBoost(base.model, base.tokenizer, config)
        report = warm_corpus(engine, texts, prefix=prefix, progress=False)
        warm[name] = {"seconds": report.seconds, "passages": report.units}
        warm[name]["max_batch_size"] = config.batch_size(base.model.device)
        systems[name] = engine_system(engine, args.max_new_tokens)
    systems["HuggingFacePipeline"] = pipeline_system(base, args.max_new_tokens)
    return {"systems": systems, "warm": warm}


def measure(
    systems: dict[str, System], levels: list[int], rounds: int, requests: list[Messages]
) -> list[dict[str, Any]]:
    """Every system at every level and round, the same requests in turn; one untimed
    request per system first. Returns one run per (level, round, system)."""
    for run in systems.values():
        run(requests[:1])
    runs, used = [], 1
    for level in levels:
        for round_ in range(rounds):
            batch, used = requests[used : used + level], used + level
            for name, run in systems.items():
                note(f"N={level} round {round_ + 1}/{rounds}: {name}")
                before = batch_before(run)
                timed = run(batch)
                runs.append(
                    {
                        "system": name,
                        "level": level,
                        "round": round_,
                        "batch": batch,
                        "timed": timed,
                        "steps": batch_delta(run, before),
                    }
                )
    return runs


def as_json(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs with per-request times in ms from the run's first start, and whether each
    answer equals the serialized engine's for the same request."""
    serial = {(r["level"], r["round"]): r["timed"] for r in runs if r["system"] == SERIAL}
    out = []
    for run in runs:
        t0 = min(t.start for t in run["timed"])
        ref = serial[(run["level"], run["round"])]
        requests = [
            {
                "question": m[-1]["content"],
                "start_ms": (t.start - t0) * 1e3,
                "ttft_ms": (t.first - t.start) * 1e3,
                "ttlt_ms": (t.end - t.start) * 1e3,
                "end_ms": (t.end - t0) * 1e3,
                "tokens": t.tokens,
                "same_as_serialized": same(t, s),
                "text": t.text,
            }
            for m, t, s in zip(run["batch"], run["timed"], ref)
        ]
        keys = ("system", "level", "round", "steps")
        out.append({**{k: run[k] for k in keys}, "requests": requests})
    return out


def record(args: argparse.Namespace) -> dict[str, Any]:
    start, load = time.perf_counter(), os.getloadavg()
    base = KVBoost.from_pretrained(args.model, dtype=args.dtype, weights=args.weights)
    texts = passages(base.tokenizer, args.chunk_tokens, args.passages)
    levels = [int(n) for n in args.levels.split(",")]
    requests = rag_requests(texts, args.k, 1 + args.rounds * sum(levels), args.seed)
    built = build(base, args, texts)
    runs = as_json(measure(built["systems"], levels, args.rounds, requests))
    settings = {k: getattr(args, k) for k in ("rounds", "k", "max_new_tokens", "fidelity")}
    return {
        "command": "kvboost-rag bench load " + " ".join(args.argv),
        "model": args.model,
        "weights": args.weights or "checkpoint",
        "quick": args.quick,
        "machine": machine(base),
        "settings": {**settings, "levels": levels, "passages": len(texts)},
        "warm": built["warm"],
        "runs": runs,
        "rows": summarize(runs),
        "load_average": {"start": load, "end": os.getloadavg()},
        "seconds": time.perf_counter() - start,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="kvboost-rag bench load", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default="float32", type=dtype_name, help="float32 (default) or bfloat16"
    )
    parser.add_argument("--fidelity", default="balanced", choices=["fast", "balanced"])
    parser.add_argument("--levels", default="1,2,4,8,16", help="concurrent requests")
    parser.add_argument("--rounds", type=positive, default=1, help="rounds per level")
    parser.add_argument("--k", type=positive, default=3, help="passages per request")
    parser.add_argument("--max-new-tokens", type=positive, default=48)
    parser.add_argument("--passages", type=positive, default=48, help="corpus size")
    parser.add_argument("--chunk-tokens", type=positive, default=200, help="tokens per passage")
    return parse_common(parser, argv, QUICK)


def main(argv: list[str] | None = None) -> None:
    run_and_write("load", parse(argv), record, table, draw)


if __name__ == "__main__":
    main()
