"""The shared Redis tier: write-through while warming, serving another process, codecs.

What write-through costs warming, a corpus warmed by one process and served by another,
and the storage codecs (size, cost, speed, accuracy).

    python -m benchmarks.remote [--units 168] [--queries 24] [--codec-queries 12]
        [--codecs none,int8,fp8] [--rounds 2] [--dtype float32] [--threads N]
        [--fidelity balanced] [--remote-url URL] [--out DIR] [--quick]

1. Warming: the first ``--units`` essay units (~140 tokens each, as in ``bench.warm``) go
   through ``warm_corpus`` into a fresh cache_dir alone (a) and into a fresh cache_dir plus
   an empty Redis namespace (b), alternated b a a b ... so drift hits both: tokens/s.
2. Serving from Redis: the last (b) warm left the units in Redis. A fresh process B, with
   an empty cache_dir of its own, answers RAG prompts of 7 units each, no unit in two
   prompts: TTFT when every passage comes from Redis, again with the same passages in a
   new order (memory), and a full prefill of the same tokens, interleaved prompt by
   prompt; and how many passages B encoded (0 when the tier served them all). A process C
   then opens B's cache_dir (filled by promotion) without Redis: the same, from disk
   (``bench.remote_serve``; a run whose processes ran different core code is refused).
3. Codecs: ``bench.remote_codecs`` on ``bench.rag``'s fact workload.

Timed requests start once the engine's queued disk and Redis writes are done, so a TTFT
measures the tier it reads; what each request writes through is reported apart. Redis is
a private ``redis-server`` started and stopped here, or ``--remote-url``'s server (each
measurement uses its own key namespace and drops it after). Prints the tables and writes
them with the numbers to ``remote-<dtype>.txt`` / ``.json`` under ``--out``. ``--quick``
runs tiny sizes (a smoke test); on a machine shared with other work ``--threads 1`` keeps
a forward pass from waiting on a busy core at every parallel region.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from benchmarks.remote import codecs as remote_codecs
from benchmarks.remote.report import print_report
from benchmarks.remote.serve import corpus_units, serve, serve_in_process, source
from benchmarks.remote.server import (
    drop,
    local_redis,
    server_version,
    used_memory,
)
from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common.baseline import write_report
from kvboost_rag.bench.common.corpus import fact_passages, passages, warm_prefix
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.bench.common.transcript import Transcript, note
from kvboost_rag.bench.warm.run import UNIT_TOKENS
from kvboost_rag.cli.arguments import ArgumentParser, dtype_name, positive

QUICK = {"units": 7, "queries": 1, "codec_queries": 1, "pool": 8, "rounds": 1}


def warm_once(base: KVBoost, texts: list[str], url: str | None, namespace: str) -> dict[str, Any]:
    """``warm_corpus`` into a fresh cache_dir, and into ``namespace`` (empty) when ``url``."""
    folder = tempfile.mkdtemp(prefix="kvboost-warm-")
    fidelity = base.config.fidelity
    config = (
        KVBoostConfig(
            cache_dir=folder, fidelity=fidelity, remote_url=url, remote_namespace=namespace
        )
        if url
        else KVBoostConfig(cache_dir=folder, fidelity=fidelity)
    )
    engine = KVBoost(base.model, base.tokenizer, config)
    before = used_memory(url) if url else 0
    report = warm_corpus(engine, texts, prefix=warm_prefix(), progress=False)
    out: dict[str, Any] = {"tier": "disk + redis" if url else "disk", **report.__dict__}
    out["tokens_per_s"] = report.tokens_per_s
    remote = engine.stats().remote
    if url and remote is not None:
        out["redis_writes"], out["redis_written_bytes"] = remote.writes, remote.written_bytes
        out["redis_used_bytes"] = used_memory(url) - before
    del engine
    gc.collect()
    shutil.rmtree(folder, ignore_errors=True)
    return out


def warm_rates(
    base: KVBoost, texts: list[str], url: str, rounds: int, run_id: str
) -> dict[str, Any]:
    """``rounds`` warms into disk alone and as many with Redis write-through, in the order
    b a a b (its tail for one round), so drift and a warming machine hit both. The last
    run writes to Redis; its namespace is kept for serving, the others are dropped."""
    order = (["disk + redis", "disk", "disk", "disk + redis"] * rounds)[-2 * rounds :]
    runs, namespace = [], ""
    for i, tier in enumerate(order):
        if namespace:
            drop(url, namespace)
        namespace = f"{run_id}-warm{i}" if tier != "disk" else ""
        note(f"warming {len(texts)} units into {tier} ({i + 1}/{len(order)})")
        runs.append(warm_once(base, texts, url if namespace else None, namespace))
    rate = {t: median([r["tokens_per_s"] for r in runs if r["tier"] == t]) for t in order}
    return {
        "order": order,
        "runs": runs,
        "disk_tokens_per_s": rate["disk"],
        "redis_tokens_per_s": rate["disk + redis"],
        "ratio": rate["disk + redis"] / rate["disk"],
        "namespace": namespace,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="python -m benchmarks.remote", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype", default=None, type=dtype_name, help="float32 or bfloat16 (default: auto)"
    )
    parser.add_argument("--fidelity", default="balanced", choices=["fast", "balanced"])
    parser.add_argument(
        "--units", type=positive, default=168, help="essay units warmed (>= 7 x queries)"
    )
    parser.add_argument("--queries", type=positive, default=24, help="prompts served by B and C")
    parser.add_argument("--codec-queries", type=positive, default=12, help="prompts per codec")
    parser.add_argument("--pool", type=positive, default=40, help="fact passages (codec workload)")
    parser.add_argument("--codecs", default="none,int8,fp8")
    parser.add_argument("--rounds", type=positive, default=2, help="warms per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=positive, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--remote-url", default=None, help="default: a private redis-server")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--quick", action="store_true", help=f"tiny sizes: {QUICK}")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", default="kvboost", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    unknown = set(args.codecs.split(",")) - set(remote_codecs.codec.CODECS)
    if unknown:
        parser.error(f"unknown codecs {sorted(unknown)}; choose from {remote_codecs.codec.CODECS}")
    return args


def measure(args: argparse.Namespace, base: KVBoost, url: str, core: str) -> dict[str, Any]:
    """The three measurements, in order; every namespace and folder removed after.
    ``core``: the digest of the core this process runs (``source``)."""
    run_id = f"kvboost-bench-{uuid.uuid4().hex[:8]}"
    texts = corpus_units(base.tokenizer, args.units)
    warm = warm_rates(base, texts, url, args.rounds, run_id)
    args.namespace = warm["namespace"]
    folder = tempfile.mkdtemp(prefix="kvboost-serve-")
    try:
        served = {
            "redis": serve_in_process(args, folder, url, core),
            "disk": serve_in_process(args, folder, None, core),
        }
    finally:
        drop(url, args.namespace)
        shutil.rmtree(folder, ignore_errors=True)
    pool = fact_passages(passages(base.tokenizer, UNIT_TOKENS, args.pool), args.seed)
    codecs = remote_codecs.measure(
        base, url, run_id, args.codecs.split(","), pool, args.codec_queries, args.seed + 7
    )
    return {"units": len(texts), "warm": warm, "serve": served, "codecs": codecs}


def record(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a run measures, with what it ran on."""
    here = source()
    start, load = time.perf_counter(), os.getloadavg()
    config = KVBoostConfig(fidelity=args.fidelity)
    base = KVBoost.from_pretrained(args.model, dtype=args.dtype, config=config)
    server = None if args.remote_url else local_redis()
    url = args.remote_url or server.url  # type: ignore[union-attr]
    try:
        result = {
            "model": args.model,
            "fidelity": args.fidelity,
            "quick": args.quick,
            "source": here,
            "machine": machine(base),
            "redis": {"version": server_version(url), "private": server is not None},
            **measure(args, base, url, here["core_sha256"]),
        }
    finally:
        if server is not None:
            server.kill()
    result["load_average"] = {"start": load, "end": os.getloadavg()}
    result["seconds"] = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serve:
        print(json.dumps(serve(args)))
        return
    result = record(args)
    transcript = Transcript()
    print_report(result, transcript.say)
    dtype = result["machine"]["dtype"]
    write_report(args.out, f"remote-{dtype}.json", result)
    (args.out / f"remote-{dtype}.txt").write_text(transcript.text())
    print(f"wrote {args.out / f'remote-{dtype}.txt'}")


if __name__ == "__main__":
    main()
