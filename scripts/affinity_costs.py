"""What a RAG prompt's passages cost by where their KV is, measured with the real engine:
``affinity_routing.py``'s first half.

Three engines on one loaded model and one private ``redis-server``, each a replica as far
as its tiers go: ``memory`` warms each round's passages first (they sit in its memory tier,
and it writes them through to Redis); ``redis`` shares that Redis namespace but its memory
never held them (it reads them from Redis, as a fresh replica does); ``encoded`` has a
namespace of its own, so nothing holds them (it encodes). A round: ``k`` fresh passages,
the same prompt (passages marked, ``bench load``'s layout, a question) on each engine,
and prompts on ``memory`` with ``e`` = 1 .. k-1 of their passages never seen (the rest
from its memory tier), all in a seeded shuffled order, answered with one token. Before
each timed call every engine's deferred encodes and writes are done. ``memory`` gets an
8 GiB memory budget, so none of what it holds is evicted during the run (a call's cost does
not depend on the budget).

Costs: the medians of the three tiers; a passage read from Redis instead of memory costs
the median over rounds of (redis - memory) / k, paired on the same prompt (drift between
rounds cancels); TTFT(m, r, e) = TTFT of e passages encoded with the rest in memory
+ r x that Redis cost (the engine's plan depends on how many passages are cached, not
where: a prompt mostly uncached is prefilled plainly).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.remote.server import client, local_redis, server_version
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.corpus import QUESTION_PREFIX, passages
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.bench.common.transcript import note
from kvboost_rag.bench.load.run import rag_messages

LAYOUT = rag_messages(["passage"], "question")  # what the passages are warmed for
TIERS = ("memory", "redis", "encoded")


@contextlib.contextmanager
def bench_lock(path: str) -> Iterator[None]:
    """Holds ``path`` (created exclusively) while other benchmarks wait; waits while
    another holds it."""
    while True:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            note(f"waiting for {path}")
            time.sleep(15)
    Path(path).write_text("affinity\n")
    stop = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally below
    try:
        yield
    finally:
        Path(path).unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, stop)


def ask(engines: dict[str, KVBoost], name: str, redis: Any, docs: list[str]) -> dict[str, Any]:
    """``docs`` asked about once on ``engines[name]``, timed, once every engine is idle;
    what the engine and the server say it did."""
    for engine in engines.values():
        engine.flush()  # deferred encodes and writes: they would share the cores
    engine = engines[name]
    question = QUESTION_PREFIX + docs[0].split(". ")[0][:120]
    before, sent = engine.stats(), redis.info("stats")["total_net_output_bytes"]
    result = engine.chat(rag_messages(docs, question), max_new_tokens=1)
    sent = redis.info("stats")["total_net_output_bytes"] - sent
    engine.flush()  # not timed: what the request leaves in the memory tier
    after = engine.stats()
    assert before.remote is not None and after.remote is not None
    return {
        "ttft_ms": result.ttft_ms,
        "prompt_tokens": result.prompt_tokens,
        "passages_hit": result.passages_hit,
        "passages_missed": result.passages_missed,
        "reused_tokens": result.reused_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "reuse_reason": result.reuse_reason,
        "redis_hits": after.remote.hits - before.remote.hits,
        "redis_sent_bytes": sent,
        "memory_tier_growth_bytes": after.cache.bytes - before.cache.bytes,
    }


def one_round(
    engines: dict[str, KVBoost], redis: Any, pools: dict[str, list[str]], k: int, rng: Any
) -> list[dict[str, Any]]:
    fresh = [pools["fresh"].pop() for _ in range(k)]
    engines["memory"].warm_passages(fresh, prefix=LAYOUT)
    calls = [(tier, k * (tier == "encoded"), fresh, True) for tier in TIERS]
    for e in range(1, k):  # on memory: e passages never seen, the rest from its memory tier
        docs = rng.sample(pools["memory"], k - e) + [pools["fresh"].pop() for _ in range(e)]
        calls.append(("memory", e, rng.sample(docs, k), False))
    rng.shuffle(calls)
    runs = [
        {"tier": tier, "encoded": e, "same_prompt": same, **ask(engines, tier, redis, docs)}
        for tier, e, docs, same in calls
    ]
    note(", ".join(f"{r['tier']} e={r['encoded']} {r['ttft_ms']:.0f} ms" for r in runs))
    return runs


def corpus(engine: KVBoost, args: argparse.Namespace) -> dict[str, list[str]]:
    """Passages the memory tier holds for the mixed prompts, two for the other engines'
    prompt heads, and fresh ones: each round takes its share."""
    memory, fresh = 2 * args.k, (args.k + args.k * (args.k - 1) // 2) * (args.rounds + 1)
    texts = passages(engine.tokenizer, args.passage_tokens, memory + fresh + 2, min_tokens=200)
    if len(texts) < memory + fresh + 2:
        raise SystemExit(f"the essays hold {len(texts)} passages: ask for fewer --rounds")
    return {"memory": texts[:memory], "heads": texts[memory : memory + 2], "fresh": texts[-fresh:]}


def engines_on(base: KVBoost, url: str, pools: dict[str, list[str]]) -> dict[str, KVBoost]:
    """The three engines, each holding the prompt head (a warm of its own passages)."""
    shared = KVBoostConfig(remote_url=url, remote_namespace="affinity")
    configs = {
        # room for every round's passages and prompts: none of its memory passages leaves
        "memory": dataclasses.replace(shared, max_cache_bytes=8 * 2**30),
        "redis": shared,
        "encoded": dataclasses.replace(shared, remote_namespace="affinity-encoded"),
    }
    out = {tier: KVBoost(base.model, base.tokenizer, configs[tier]) for tier in TIERS}
    out["memory"].warm_passages(pools["memory"], prefix=LAYOUT)
    out["redis"].warm_passages(pools["heads"][:1], prefix=LAYOUT)
    out["encoded"].warm_passages(pools["heads"][1:], prefix=LAYOUT)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    base = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    server, rng = local_redis(), random.Random(args.seed)
    try:
        with bench_lock(args.lock):
            pools = corpus(base, args)
            engines = engines_on(base, server.url, pools)
            redis = client(server.url)
            one_round(engines, redis, pools, args.k, rng)  # untimed: every first call
            load, runs = os.getloadavg(), []  # other work on the machine shows in the load
            for i in range(args.rounds):
                runs += [
                    {"round": i, **run} for run in one_round(engines, redis, pools, args.k, rng)
                ]
            load_average = {"start": load, "end": os.getloadavg()}
            per_passage = engines["memory"].warm_passages(pools["memory"], prefix=LAYOUT)
            for engine in engines.values():
                engine.flush()
        version = server_version(server.url)
    finally:
        server.kill()
    return costs(runs, args.k) | {
        "passage_kv_bytes": per_passage.bytes / per_passage.units,
        "machine": machine(base),
        "load_average": load_average,
        "redis": {"version": version, "url": "private, loopback"},
        "runs": runs,
    }


def costs(runs: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Every kind of call's spread, and the costs the simulation takes: each call as a share
    of its round's encoded call (the machine's speed swings 2-3x between minutes; a round
    takes half of one), the median share times the median encoded call. A passage read
    from Redis, not memory: (redis - memory) / k, paired on the round's prompt."""
    rounds: dict[int, dict[str, float]] = {}
    for run in runs:
        name = run["tier"] if run["same_prompt"] else f"{run['encoded']} of {k} encoded"
        rounds.setdefault(run["round"], {})[name] = run["ttft_ms"]
    for calls in rounds.values():
        calls["redis read"] = (calls["redis"] - calls["memory"]) / k
    gauge = statistics.median(calls["encoded"] for calls in rounds.values())
    spreads = {}
    for name in rounds[0]:
        values = [calls[name] for calls in rounds.values()]
        shares = [calls[name] / calls["encoded"] for calls in rounds.values()]
        spreads[name] = {"median": statistics.median(values), "min": min(values)}
        spreads[name] |= {"max": max(values), "scaled": gauge * statistics.median(shares)}
    cost = {0: spreads["memory"]["scaled"], k: gauge}
    cost |= {e: spreads[f"{e} of {k} encoded"]["scaled"] for e in range(1, k)}
    read = spreads["redis read"]["scaled"]
    tiers = {t: [r for r in runs if r["tier"] == t and r["same_prompt"]] for t in TIERS}
    sent = statistics.median(r["redis_sent_bytes"] for r in tiers["redis"])
    # what a request whose passages were all in memory left there: its prompt's KV
    prompt = [
        r["memory_tier_growth_bytes"] for r in tiers["memory"] if "memory_tier_growth_bytes" in r
    ]
    return {
        "prompt_kv_bytes": statistics.median(prompt) if prompt else None,  # older records: none
        "calls": spreads,
        "costs": {
            f"{m},{r},{k - m - r}": cost[k - m - r] + r * read
            for m in range(k + 1)
            for r in range(k + 1 - m)
        },
        "redis_bytes_per_passage": sent / k,
        # calls that read (redis), encoded (encoded) or found (memory) all k, as intended
        "as_intended": {
            "memory": sum(
                r["redis_hits"] == 0 and not r["passages_missed"] for r in tiers["memory"]
            ),
            "redis": sum(r["redis_hits"] >= k and not r["passages_missed"] for r in tiers["redis"]),
            "encoded": sum(r["passages_hit"] == 0 for r in tiers["encoded"]),
        },
    }
