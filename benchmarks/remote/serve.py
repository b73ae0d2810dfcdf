"""The serving side of ``bench.remote``: a fresh process answering RAG prompts over units
another process warmed, timed per tier, and the check that every process of a run ran the
same core."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

from benchmarks.remote.server import settle
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.baseline import full_prefill
from kvboost_rag.bench.common.corpus import FactPassage, messages_for, passages
from kvboost_rag.bench.common.metrics import median, p90
from kvboost_rag.bench.common.transcript import note
from kvboost_rag.bench.warm.run import UNIT_TOKENS
from kvboost_rag.core import engine as engine_module
from kvboost_rag.core.model.kv import LayerKV

PASSAGES_PER_PROMPT = 7


def corpus_units(tokenizer: Any, count: int) -> list[str]:
    """The first ``count`` retrieval units of the essay corpus (``bench.warm``'s units)."""
    return passages(tokenizer, UNIT_TOKENS, count, min_tokens=1)


def source() -> dict[str, Any]:
    """Which core this process runs: a digest of the core package's source files (as found
    now, at the process's start) and the git commit of the checkout, with whether core/
    differs from it. Every process of a run must report the same digest."""
    folder = Path(engine_module.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    git = partial(subprocess.run, capture_output=True, text=True, cwd=folder)
    commit = git(["git", "rev-parse", "HEAD"])
    changed = git(["git", "status", "--porcelain", "--", "."]).stdout.strip()
    return {
        "core_sha256": digest.hexdigest()[:16],
        "git_commit": commit.stdout.strip() if commit.returncode == 0 else None,
        "core_differs_from_commit": bool(changed) if commit.returncode == 0 else None,
    }


def disjoint_queries(texts: list[str], n: int, seed: int) -> list[list[FactPassage]]:
    """``n`` prompts of ``PASSAGES_PER_PROMPT`` units, no unit in two prompts, so a
    prompt's first serving reads every passage from the tier under test."""
    k = PASSAGES_PER_PROMPT
    if k * n > len(texts):
        raise ValueError(f"{n} prompts of {k} distinct units need --units >= {k * n}")
    picks = random.Random(seed).sample(texts, k * n)
    pool = [FactPassage(t, "What is this passage about?", "") for t in picks]
    return [pool[i * k : (i + 1) * k] for i in range(n)]


@contextmanager
def count_encoded(engine: KVBoost) -> Iterator[list[int]]:
    """A counter of the passages ``engine`` encodes while inside (its encoder wrapped)."""
    cache = engine.inspect.passage_cache
    assert cache is not None, "passage reuse is off"
    encoder = cache.encoder
    original, counter = encoder.encode_batch, [0]

    def encode_batch(prefix: Sequence[int], pieces: Sequence[Sequence[int]]) -> list[LayerKV]:
        counter[0] += len(pieces)  # every passage encode goes through one such forward
        return original(prefix, pieces)

    with patch.object(encoder, "encode_batch", encode_batch):
        yield counter


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: the prompts over warmed units, first from the lower tiers
    (Redis when ``--remote-url``, else disk), again from memory, and a full prefill."""
    origin = source()
    config = KVBoostConfig(
        cache_dir=args.cache_dir,
        remote_url=args.remote_url,
        remote_namespace=args.namespace,
        fidelity=args.fidelity,
    )
    engine = KVBoost.from_pretrained(args.model, dtype=args.dtype, config=config)
    ttft: dict[str, list[float]] = {"first": [], "again": [], "full": []}
    missed = foreign = hit = 0
    question = "What is this passage about?"
    units = corpus_units(engine.tokenizer, args.units)
    with count_encoded(engine) as encoded:
        for docs in disjoint_queries(units, args.queries, 3):
            first = settle(engine).chat(messages_for(docs, question), max_new_tokens=1)
            again = settle(engine).chat(messages_for(docs[::-1], question), max_new_tokens=1)
            tokens = partial(engine.tokenize_chat, messages_for(docs, question))
            ttft["full"].append(full_prefill(settle(engine).model, tokens, 1).ttft_ms)
            ttft["first"].append(first.ttft_ms)
            ttft["again"].append(again.ttft_ms)
            hit += first.passages_hit
            missed += first.passages_missed + again.passages_missed
            foreign += first.passages_foreign + again.passages_foreign
    stats = engine.stats()
    return {
        "tier": "redis" if args.remote_url else "disk",
        "source": origin,
        "queries": args.queries,
        **{f"{k}_ttft_ms": median(v) for k, v in ttft.items()},
        **{f"{k}_p90_ttft_ms": p90(v) for k, v in ttft.items()},
        "passages_hit_first": hit,
        "passages_missed": missed,
        "passages_foreign": foreign,
        "passages_encoded": encoded[0],
        "requests": stats.requests,
        "remote": stats.remote.__dict__ if stats.remote else None,
        "disk": stats.disk.__dict__ if stats.disk else None,
    }


def serve_in_process(
    args: argparse.Namespace, cache_dir: str, url: str | None, core: str
) -> dict[str, Any]:
    """``serve`` in a fresh Python process; its JSON answer. Raises ``RuntimeError`` when
    it failed, or ran another core than ``core`` (a digest: the files changed meanwhile)."""
    note(f"serving {args.queries} prompts in a fresh process from {'Redis' if url else 'disk'}")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.remote.run",
        "--serve",
        "--cache-dir",
        cache_dir,
    ]
    cmd += ["--model", args.model, "--fidelity", args.fidelity, "--namespace", args.namespace]
    cmd += ["--units", str(args.units), "--queries", str(args.queries)]
    cmd += ["--threads", str(torch.get_num_threads())]
    cmd += (["--dtype", args.dtype] if args.dtype else []) + (["--remote-url", url] if url else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"serving process failed:\n{done.stderr[-4000:]}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if answer["source"]["core_sha256"] != core:
        raise RuntimeError(
            f"core/ changed during the run (this process {core}, the serving process "
            f"{answer['source']['core_sha256']}): rerun on a checkout nobody edits"
        )
    return answer
