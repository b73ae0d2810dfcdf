"""What routing replicas by passage affinity would gain: real per-passage costs measured on
this machine, then routers simulated with them.

    .venv/bin/python scripts/affinity_routing.py --model smollm2-135m-instruct --dtype float32
        --out docs/bench/affinity-routing-smollm2-135m-instruct-float32.json
        [--k 4] [--rounds 4] [--passage-tokens 300] [--costs RECORD.json]

1. Measured: one engine (a replica) on a private ``redis-server``. A RAG prompt of ``--k``
   essay passages (200 to ``--passage-tokens`` tokens, marked, in ``bench load``'s layout)
   and a question, answered with one token; its TTFT for every mix of where the passages'
   KV is: in this engine's memory tier (warmed by it), only in Redis (warmed by another
   engine on the same server: this one's memory never held them), or nowhere (encoded).
   Every mix once a round in a seeded shuffled order, fresh passages each time, ``--rounds``
   rounds; medians. Each request starts once the previous one's deferred encodes and
   writes are done. Also: the KV bytes of a passage in memory, and the bytes Redis sent
   per passage read (the server's ``total_net_output_bytes``). The timed part holds
   ``--lock`` (waiting while another benchmark holds it).
2. Simulated (``affinity_sim.py``): 2, 4 and 8 replicas, each with a memory tier of
   ``KVBoostConfig().max_cache_bytes`` / a passage's KV bytes passages (an upper bound: the
   tier also holds prompts' exact prefixes), Zipf s 0.6 / 1.0 / 1.2, the routers of
   ``affinity_sim.routers``; each request's TTFT estimate is the measured median of its mix
   (service time: queueing on a busier replica is not in it; the load imbalance is shown
   beside it). ``--costs`` simulates again from a record's measured costs, with no model.

Prints the tables; writes the JSON, ``.txt`` and (with matplotlib) ``.png`` beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling simulation

import affinity_sim as sim  # noqa: E402

from kvboost_rag import KVBoost, KVBoostConfig  # noqa: E402
from kvboost_rag.bench.common.corpus import passages  # noqa: E402
from kvboost_rag.bench.common.systems import machine  # noqa: E402
from kvboost_rag.bench.common.transcript import note  # noqa: E402
from kvboost_rag.bench.load.run import rag_messages  # noqa: E402
from kvboost_rag.bench.rag.langchain_rag import QUESTION_PREFIX  # noqa: E402
from kvboost_rag.bench.remote.server import client, local_redis, server_version  # noqa: E402

TIERS = ("memory", "redis", "encoded")
LAYOUT = rag_messages(["passage"], "question")  # what the passages are warmed for
MEASURED = ("machine", "redis", "costs", "passage_kv_bytes", "redis_bytes_per_read", "runs")
MEASURED += ("date", "model", "rounds", "k", "measured_by")  # what --costs takes from a record


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
    try:
        yield
    finally:
        Path(path).unlink(missing_ok=True)


def mixes(k: int) -> list[tuple[int, int, int]]:
    """Every (memory, redis, encoded) split of ``k`` passages."""
    return [(m, r, k - m - r) for m in range(k + 1) for r in range(k + 1 - m)]


def one_request(engine: KVBoost, redis: Any, docs: list[str]) -> dict[str, Any]:
    """``docs`` asked about once, timed; what the engine and the server say it did."""
    question = QUESTION_PREFIX + docs[0].split(". ")[0][:120]
    engine.flush()  # the previous request's deferred encodes and writes are done
    remote, sent = engine.stats().remote, redis.info("stats")["total_net_output_bytes"]
    result = engine.chat(rag_messages(docs, question), max_new_tokens=1)
    after = engine.stats().remote
    assert remote is not None and after is not None
    return {
        "ttft_ms": result.ttft_ms,
        "prompt_tokens": result.prompt_tokens,
        "passages_hit": result.passages_hit,
        "passages_missed": result.passages_missed,
        "passages_foreign": result.passages_foreign,
        "reused_tokens": result.reused_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "reuse_reason": result.reuse_reason,
        "redis_hits": after.hits - remote.hits,
        "redis_sent_bytes": redis.info("stats")["total_net_output_bytes"] - sent,
    }


def timed(
    engine: KVBoost, redis: Any, pools: dict[str, list[str]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every mix once a round, in a shuffled order, fresh Redis and new passages each."""
    rng, runs = random.Random(args.seed), []
    one_request(engine, redis, rng.sample(pools["memory"], args.k))  # untimed: first call
    for round_ in range(args.rounds):
        order = mixes(args.k)
        rng.shuffle(order)
        for mix in order:
            docs = rng.sample(pools["memory"], mix[0])
            docs += [pools["redis"].pop() for _ in range(mix[1])]
            docs += [pools["encoded"].pop() for _ in range(mix[2])]
            rng.shuffle(docs)
            runs.append({"round": round_, "mix": mix, **one_request(engine, redis, docs)})
            note(f"round {round_ + 1}/{args.rounds} mix {mix}: {runs[-1]['ttft_ms']:.0f} ms")
    return runs


def corpus(engine: KVBoost, args: argparse.Namespace) -> dict[str, list[str]]:
    """The three pools: passages for the memory tier, for Redis only, never stored."""
    fresh = sum(m[1] for m in mixes(args.k)) * args.rounds  # as many of each fresh kind
    memory = 2 * args.k  # each used ~2.5 times a round: never evicted by the fresh ones
    texts = passages(engine.tokenizer, args.passage_tokens, memory + 2 * fresh, min_tokens=200)
    if len(texts) < memory + 2 * fresh:
        raise SystemExit(f"the essays hold {len(texts)} passages: ask for fewer --rounds")
    return {
        "memory": texts[:memory],
        "redis": texts[memory : memory + fresh],
        "encoded": texts[memory + fresh :],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    base = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    server = local_redis()
    try:
        config = KVBoostConfig(remote_url=server.url, remote_namespace="affinity")
        with bench_lock(args.lock):
            pools = corpus(base, args)
            note(f"warming {len(pools['redis'])} passages into Redis through another engine")
            writer = KVBoost(base.model, base.tokenizer, config)
            writer.warm_passages(pools["redis"], prefix=LAYOUT)
            del writer
            gc.collect()
            engine = KVBoost(base.model, base.tokenizer, config)
            warmed = engine.warm_passages(pools["memory"], prefix=LAYOUT)
            runs = timed(engine, client(server.url), pools, args)
        redis = {"version": server_version(server.url), "url": "private, loopback"}
    finally:
        server.kill()
    found = costs(runs, warmed.bytes / warmed.units)
    return {"machine": machine(base), "redis": redis, **found, "runs": runs}


def costs(runs: list[dict[str, Any]], passage_bytes: float) -> dict[str, Any]:
    """Medians by mix, and what a passage weighs in memory and on the wire."""
    table = {}
    for mix in sorted({tuple(r["mix"]) for r in runs}, reverse=True):
        mine = [r for r in runs if tuple(r["mix"]) == mix]
        table[",".join(map(str, mix))] = {
            "ttft_ms": statistics.median(r["ttft_ms"] for r in mine),
            "min_ms": min(r["ttft_ms"] for r in mine),
            "max_ms": max(r["ttft_ms"] for r in mine),
            "rounds": len(mine),
            # runs that read from Redis and encoded what their mix says (none evicted)
            "as_expected": sum((r["redis_hits"], r["passages_missed"]) == mix[1:] for r in mine),
        }
    read = [r for r in runs if r["redis_hits"]]
    per_read = sum(r["redis_sent_bytes"] for r in read) / max(1, sum(r["redis_hits"] for r in read))
    return {"costs": table, "passage_kv_bytes": passage_bytes, "redis_bytes_per_read": per_read}


def simulate(record: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    table = {tuple(map(int, k.split(","))): v["ttft_ms"] for k, v in record["costs"].items()}
    rows = []
    for warmed, zipfs in ((True, args.zipf), (False, args.cold_zipf)):
        for s in zipfs:
            note(f"simulating zipf s={s}, Redis {'warmed' if warmed else 'empty'}")
            w = sim.Workload(args.corpus, k=args.k, zipf=s, requests=args.requests, warmed=warmed)
            rows += sim.compare(w, args.replicas, record["memory_passages"], table)
    return rows


def cost_lines(record: dict[str, Any]) -> list[str]:
    lines = [f"{'memory':>6} {'redis':>5} {'encoded':>7} {'TTFT ms':>8} {'min':>7} {'max':>7}"]
    for key, c in record["costs"].items():
        m, r, e = key.split(",")
        lines.append(
            f"{m:>6} {r:>5} {e:>7} {c['ttft_ms']:8.0f} {c['min_ms']:7.0f} {c['max_ms']:7.0f}"
            + ("" if c["as_expected"] == c["rounds"] else f"  ({c['as_expected']} as mixed)")
        )
    return lines


FORMATS = {"memory_share": ".1%", "redis_share": ".1%", "encode_share": ".1%", "imbalance": ".2f"}


def router_lines(rows: list[dict[str, Any]]) -> list[str]:
    keys = ("memory_share", "redis_share", "encode_share", "ttft_mean_ms", "ttft_p50_ms")
    keys += ("ttft_p99_ms", "imbalance")
    heads = ("memory", "redis", "encode", "TTFT mean", "p50", "p99", "max/mean")
    lines = [f"{'Redis':6} {'s':>3} {'R':>2} {'router':31} " + " ".join(f"{h:>9}" for h in heads)]
    for row in rows:
        cells = [f"{row[k]:9{FORMATS.get(k, '.0f')}}" for k in keys]
        lines.append(
            f"{row['redis']:6} {row['zipf']:3.1f} {row['replicas']:2} {row['router']:31} "
            + " ".join(cells)
        )
    return lines


def text(record: dict[str, Any]) -> str:
    m = record["machine"]
    head = [
        f"{record['command']}",
        f"{record['date']}, {m['cpu']} ({m['cpu_count']} cores, {m['threads']} threads), "
        f"{record['model']} {m['dtype']}, redis {record['redis']['version']}",
        "",
        f"TTFT of a {record['k']}-passage prompt by where its passages' KV is "
        f"(medians of {record['rounds']} interleaved rounds):",
        *cost_lines(record),
        "",
        f"a passage: {record['passage_kv_bytes'] / 2**20:.2f} MiB of KV in memory, "
        f"{record['redis_bytes_per_read'] / 2**20:.2f} MiB sent by Redis per read; "
        f"memory tier: {record['memory_passages']} passages a replica",
        "",
        f"simulated: {record['requests']} requests over {record['corpus']} passages, Redis "
        "warmed with all of them or empty at first (TTFT estimate: the measured median of "
        "each request's mix, no queueing):",
        *router_lines(record["rows"]),
    ]
    return "\n".join(head) + "\n"


def draw(record: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note("matplotlib is not installed: no chart")
        return
    warmed = [r for r in record["rows"] if r["redis"] == "warmed"]
    zipfs = sorted({r["zipf"] for r in warmed})
    fig, grid = plt.subplots(1, len(zipfs), figsize=(5 * len(zipfs), 4), sharey=True, squeeze=False)
    axes = list(grid[0])
    for ax, s in zip(axes, zipfs):
        rows = [r for r in warmed if r["zipf"] == s]
        for name in dict.fromkeys(r["router"] for r in rows):
            mine = [r for r in rows if r["router"] == name]
            ax.plot([r["replicas"] for r in mine], [r["ttft_mean_ms"] for r in mine], "o-")
            ax.lines[-1].set_label(name)
        ax.set(title=f"Zipf s={s}", xlabel="replicas", xticks=sorted({r["replicas"] for r in rows}))
    axes[0].set_ylabel(f"mean TTFT estimate, ms ({record['model']})")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, required=True, help="the record's JSON path")
    parser.add_argument("--k", type=int, default=4, help="passages a prompt")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--passage-tokens", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lock", default="/tmp/kvboost-bench.lock")
    parser.add_argument("--costs", type=Path, help="a record whose measured costs to reuse")
    parser.add_argument("--memory-passages", type=int, help="default: the memory budget's")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--zipf", type=float, nargs="+", default=[0.6, 1.0, 1.2])
    parser.add_argument(
        "--cold-zipf", type=float, nargs="*", default=[1.0], help="also with Redis empty"
    )
    parser.add_argument("--corpus", type=int, default=10_000, help="passages simulated")
    parser.add_argument("--requests", type=int, default=40_000, help="requests simulated")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.costs:  # what was measured, as it was recorded
        measured = {k: v for k, v in json.loads(args.costs.read_text()).items() if k in MEASURED}
    else:
        measured = measure(args) | {"date": datetime.date.today().isoformat()}
        measured |= {"model": args.model, "rounds": args.rounds, "k": args.k}
        measured["measured_by"] = " ".join(["scripts/affinity_routing.py", *sys.argv[1:]])
    args.k = measured["k"]
    budget = KVBoostConfig().max_cache_bytes
    record = measured | {
        "command": " ".join([".venv/bin/python scripts/affinity_routing.py", *sys.argv[1:]]),
        "memory_budget_bytes": budget,
        "memory_passages": args.memory_passages or int(budget // measured["passage_kv_bytes"]),
        "corpus": args.corpus,
        "requests": args.requests,
        "workload": sim.Workload().__dict__ | {"zipf": args.zipf, "replicas": args.replicas},
    }
    record["rows"] = simulate(record, args)
    report = text(record)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".txt").write_text(report)
    draw(record, args.out.with_suffix(".png"))
    note(f"wrote {args.out} and its .txt / .png")


if __name__ == "__main__":
    main()
