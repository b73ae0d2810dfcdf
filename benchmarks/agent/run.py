"""Agent benchmark: a LangChain tool-calling agent and a LlamaIndex ``FunctionAgent`` on the
engine, answering questions over the essay corpus with a retriever tool and a calculator.

Per model call (step) it reports the prompt size, the share of it read from cache, TTFT on
the engine, and the same step's prompt replayed through a full prefill (no cache, same
grammar and sampling): its TTFT and whether the answer is the same. The frameworks' own HF
LLMs are probed for whether they can run the same loop at all.

    python -m benchmarks.agent --out docs/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.agent import loop as agent_loop
from benchmarks.common.records import write_record
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive
from kvboost_rag.cli.rag_setup import essay_documents
from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.engine import KVBoost
from kvboost_rag.warm import warm_corpus

FRAMEWORKS = {"langchain": agent_loop.run_langchain, "llamaindex": agent_loop.run_llamaindex}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m benchmarks.agent", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="folder for agent.json/.txt")
    parser.add_argument(
        "--dtype", default="float32", type=dtype_name, choices=["float32", "bfloat16"]
    )
    parser.add_argument("--fidelity", default="balanced", choices=["balanced", "fast", "exact"])
    parser.add_argument("--tag", default="", help="suffix of the output files' names")
    parser.add_argument("--chunks", type=positive, default=60, help="essay chunks in the index")
    parser.add_argument("--chunk-tokens", type=positive, default=160)
    parser.add_argument("--k", type=positive, default=3, help="passages per search")
    parser.add_argument("--max-tokens", type=positive, default=96)
    parser.add_argument(
        "--frameworks", nargs="+", default=list(FRAMEWORKS), choices=list(FRAMEWORKS)
    )
    parser.add_argument("--no-probe", action="store_true", help="skip the HF LLM probes")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = KVBoost.from_pretrained("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    docs = essay_documents(base, args.chunks, args.chunk_tokens)
    reference = KVBoost(base.model, base.tokenizer, KVBoostConfig(fidelity="exact"))
    report: dict[str, Any] = {
        "machine": machine(base),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "frameworks": {},
    }
    for name in args.frameworks:
        config = KVBoostConfig(fidelity=args.fidelity)
        engine = agent_loop.RecordingEngine(base, config, reference)
        warm_corpus(engine, docs)
        FRAMEWORKS[name](engine, docs, args.k, args.max_tokens)
        steps = [step_row(s) for s in engine.steps]
        report["frameworks"][name] = {"steps": steps, "summary": summary(steps)}
    if not args.no_probe:
        report["hf_probes"] = {
            "langchain ChatHuggingFace": agent_loop.hf_langchain_probe(base, docs, args.max_tokens),
            "llamaindex HuggingFaceLLM": agent_loop.hf_llamaindex_probe(base, args.max_tokens),
        }
    return report


def step_row(step: agent_loop.Step) -> dict[str, Any]:
    r, full = step.result, step.full
    return {
        "tool_choice": step.tool_choice,
        "calls": [c.name for c in r.tool_calls],
        "invalid_calls": len(r.invalid_tool_calls),
        "prompt_tokens": r.prompt_tokens,
        "reused_tokens": r.reused_tokens,
        "reuse": round(r.kv_reuse_ratio, 4),
        "passages_hit": r.passages_hit,
        "passages_foreign": r.passages_foreign,
        "passages_missed": r.passages_missed,
        "ttft_ms": round(r.ttft_ms, 1),
        "full_prefill_ttft_ms": round(full.ttft_ms, 1),
        "speedup": round(full.ttft_ms / r.ttft_ms, 2) if r.ttft_ms else None,
        "same_as_full_prefill": agent_loop.same_answer(r, full),
        "timings": dataclasses.asdict(r.timings),
    }


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    later = steps[1:]
    return {
        "steps": len(steps),
        "tool_calls": sum(len(s["calls"]) for s in steps),
        "invalid_calls": sum(s["invalid_calls"] for s in steps),
        "min_reuse_from_step_2": min((s["reuse"] for s in later), default=None),
        "median_reuse_from_step_2": statistics.median(s["reuse"] for s in later) if later else None,
        "steps_from_2_at_90pct": sum(s["reuse"] >= 0.9 for s in later),
        "median_ttft_ms": statistics.median(s["ttft_ms"] for s in steps),
        "median_full_prefill_ttft_ms": statistics.median(s["full_prefill_ttft_ms"] for s in steps),
        "same_as_full_prefill": sum(s["same_as_full_prefill"] for s in steps),
    }


def table(report: dict[str, Any]) -> str:
    lines = []
    for name, data in report["frameworks"].items():
        lines += [
            f"## {name}",
            "| step | choice | calls | prompt | from cache | TTFT | full prefill | speed-up "
            "| same |",
            "|---:|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for i, s in enumerate(data["steps"], 1):
            calls = ",".join(s["calls"]) or "-"
            lines.append(
                f"| {i} | {s['tool_choice']} | {calls} | {s['prompt_tokens']} | "
                f"{s['reuse']:.0%} | {s['ttft_ms']:.0f} ms | {s['full_prefill_ttft_ms']:.0f} ms "
                f"| {s['speedup']}x | {'yes' if s['same_as_full_prefill'] else 'no'} |"
            )
        lines += ["", json.dumps(data["summary"]), ""]
    for name, probe in report.get("hf_probes", {}).items():
        lines.append(f"- {name}: {json.dumps(probe)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    text = table(report)
    print(text)
    if args.out is not None:
        write_record(args.out, f"agent{args.tag}", report, text)


if __name__ == "__main__":
    main()
