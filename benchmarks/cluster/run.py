"""The shared tier's request path on one Redis server and on a 3-master Redis Cluster:
round trips and lookup time of a 7-passage prompt, before batching and after.

    python -m benchmarks.cluster [--prompts 12] [--pool-tokens 100] [--threads N]
        [--out DIR] [--quick]

The embedded model (SmolLM2-135M-Instruct) warms a system head (an exact prefix: its full
blocks) and a pool of essay passages (~``--pool-tokens`` tokens each, encoded after that
head) into a private ``redis-server`` and into a private 3-master cluster, both on loopback
ports, started and stopped here; each is measured on loopback, then behind links that add
1 ms to every round trip (``DelayedLink``; the cluster announces the links' ports). Per
topology and network, two fresh engines with no disk folder look up the same prompts (the
head, 7 passages no other prompt has, a question), prompt by prompt in turn, so every
passage comes from the shared tier: "per entry" reads the tiers one key at a time
(``PerEntry``: the access pattern before batching, each lookup its own round trip, the
chain of prefix blocks walked block by block up to the first missing), "batched" is the
engine as it is. Per prompt: the round trips its client counted (``RemoteStats``: flights
of commands; a batch to a cluster is one per node, all sent before any answer is read) and
the lookup's wall time (what a request spends in ``Caches.look_up`` before its model is
taken: keys, the prefix chain, the passages' variants, KV decoding) and the part of it
spent waiting on the shared tier's batches (sent, answered, parsed; not decoded). The two
engines alternate going first. The code before batching also sent an EXISTS ahead of each
prefix block's GET it had not indexed and asked the shared tier for session blocks it
never holds, so its counts were higher than the "per entry" row's: the row is a lower
bound on what batching saved.

Also: the warm's write round trips (a pipeline of EXISTS then one of SETs per batch; the
code before sent both per value), how the cluster spread the keys over its masters, and a
check that a request after the lookups found all 7 passages (0 encoded). A first prompt
per engine opens its connections and is not counted. Prints the table and writes it with
the numbers to ``cluster.txt`` / ``cluster.json`` under ``--out``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

from benchmarks.common.cluster_server import ClusterProcess
from benchmarks.common.redis_server import DelayedLink, RedisProcess
from kvboost_rag import KVBoost, KVBoostConfig, format_passages, warm_corpus
from kvboost_rag.bench.common.corpus import passages
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.cli.arguments import ArgumentParser, positive
from kvboost_rag.core.store.memory import Entry
from kvboost_rag.core.store.remote import RemoteStore
from kvboost_rag.core.store.remote_link import RemoteLink
from kvboost_rag.core.store.tiers import TieredStore

PER_PROMPT = 7
HEAD = (
    "You are a careful research assistant. Answer the question from the notes below only, "
    "quote the note you rely on, and say plainly when the notes do not hold the answer.\n\n"
)
QUESTION = "What is the main point of these notes?"
DELAY_S = 0.0005  # each way: a 1 ms round trip, as between machines in one datacentre
RTT_NAME = "+1 ms RTT"
Item = tuple[bytes, tuple[int, ...] | None]


class PerEntry(TieredStore):
    """The tiers read one key at a time, as before batching: each shared-tier lookup its
    own round trip, a chain of prefix blocks walked up to the first missing one."""

    def get_many(self, items: Sequence[Item], share: bool = True) -> list[Entry | None]:
        return [TieredStore.get_many(self, [item], share)[0] for item in items]

    def get_chain(self, items: Sequence[Item], share: bool = True) -> list[Entry]:
        chain: list[Entry] = []
        for item in items:
            entry = TieredStore.get_many(self, [item], share)[0]
            if entry is None:
                break
            chain.append(entry)
        return chain

    def contains_many(self, keys: Sequence[bytes], share: bool = True) -> list[bool]:
        return [TieredStore.contains_many(self, [key], share)[0] for key in keys]


def prompt(docs: Sequence[str]) -> str:
    return HEAD + format_passages(docs) + QUESTION


def engine(base: KVBoost, url: str, per_entry: bool = False) -> KVBoost:
    served = KVBoost(base.model, base.tokenizer, KVBoostConfig(remote_url=url))
    if per_entry:  # the same tiers, read one key at a time
        served.inspect.tiers.__class__ = PerEntry
    return served


def warm(base: KVBoost, url: str, pool: list[str]) -> dict[str, Any]:
    """Warm the head and the pool into ``url``; what the writes cost."""
    writer = engine(base, url)
    writer.warm(HEAD)
    report = warm_corpus(writer, pool, prefix=prompt(["placeholder"]), progress=False)
    writer.flush()
    stats = writer.stats().remote
    assert stats is not None and stats.errors == 0, stats
    return {
        "writes": stats.writes,
        "write_round_trips": stats.round_trips,
        "passage_tokens": report.tokens,
        "written_bytes": stats.written_bytes,
    }


def look_up(served: KVBoost, docs: Sequence[str]) -> dict[str, float]:
    """One request's lookup: its round trips, wall time (and the part of it spent waiting
    on the shared tier's answers) and passages found."""
    remote = served.inspect.tiers.tier("remote")
    assert isinstance(remote, RemoteStore)
    tokenized = served.inspect.prompt(prompt(docs))
    before = remote.stats().round_trips
    with tier_waits() as waits:
        start = time.perf_counter()
        found = served.inspect.look_up(tokenized)
        lookup_ms = (time.perf_counter() - start) * 1e3
    return {
        "round_trips": remote.stats().round_trips - before,
        "lookup_ms": lookup_ms,
        "tier_ms": sum(waits) * 1e3,
        "passages_found": sum(kv is not None for kv in found.passage_kv),
        "prefix_tokens": found.matched,
    }


@contextmanager
def tier_waits() -> Iterator[list[float]]:
    """Seconds each shared-tier batch sent from this thread takes while inside (sent,
    answered, parsed; the values' decoding and checks are not in it). A lookup reads the
    tiers on the caller's thread; other threads' batches (writers) are not counted."""
    waits: list[float] = []
    send, thread = RemoteLink.pipeline, threading.get_ident()

    def pipeline(
        link: RemoteLink,
        command: str,
        names: Sequence[bytes],
        values: Sequence[bytes] | None = None,
        bounded: bool = False,
        write: bool = False,
    ) -> list[Any]:
        start = time.perf_counter()
        try:
            return send(link, command, names, values, bounded, write)
        finally:
            if threading.get_ident() == thread:
                waits.append(time.perf_counter() - start)

    with patch.object(RemoteLink, "pipeline", pipeline):
        yield waits


def measure(base: KVBoost, url: str, prompts: list[list[str]]) -> dict[str, Any]:
    """Both modes on the same prompts, in turn; the first prompt opens the connections."""
    engines = {"per entry": engine(base, url, True), "batched": engine(base, url)}
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
    for i, docs in enumerate(prompts):
        order = list(engines) if i % 2 else list(engines)[::-1]  # neither always goes first
        for mode in order:
            run = look_up(engines[mode], docs)
            if i:
                runs[mode].append(run)
    check = engines["batched"]
    check.clear_cache()  # memory only: the request reads the shared tier again
    answer = check.generate(prompt(prompts[-1]), max_new_tokens=1)
    return {
        "modes": {mode: summary(found) for mode, found in runs.items()},
        "check": {"passages_hit": answer.passages_hit, "passages_missed": answer.passages_missed},
    }


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "round_trips": sorted({int(r["round_trips"]) for r in runs}),
        "round_trips_median": statistics.median(r["round_trips"] for r in runs),
        "lookup_ms_p50": statistics.median(r["lookup_ms"] for r in runs),
        "lookup_ms_max": max(r["lookup_ms"] for r in runs),
        "tier_ms_p50": statistics.median(r["tier_ms"] for r in runs),
        "passages_found": min(int(r["passages_found"]) for r in runs),
        "prefix_tokens": int(runs[0]["prefix_tokens"]),
        "requests": len(runs),
    }


def table(result: dict[str, Any]) -> str:
    matched = result["topologies"]["one server"]["loopback"]["modes"]["batched"]["prefix_tokens"]
    lines = [
        f"Shared tier request path: {result['model']} {result['machine']['dtype']}, "
        f"{result['machine']['threads']} threads, {result['machine']['cpu']}; "
        f"{result['requests']} prompts of {PER_PROMPT} passages (median "
        f"{result['prompt_tokens']:.0f} tokens, the first {matched} the head, an exact prefix "
        f"held in memory after the first prompt), redis-server {result['redis']}",
        "",
        "topology        network      lookup     round trips  lookup ms p50    max  "
        "waiting on the tier p50  found",
    ]
    for name, topology in result["topologies"].items():
        for network in ("loopback", RTT_NAME):
            for mode, row in topology[network]["modes"].items():
                trips = "/".join(map(str, row["round_trips"]))
                lines.append(
                    f"{name:<15} {network:<12} {mode:<10} {trips:>11}  "
                    f"{row['lookup_ms_p50']:>13.1f} {row['lookup_ms_max']:>6.1f}  "
                    f"{row['tier_ms_p50']:>23.1f}  {row['passages_found']}/{PER_PROMPT}"
                )
    lines.append("")
    for name, topology in result["topologies"].items():
        warmed, check = topology["warm"], topology["loopback"]["check"]
        lines.append(
            f"{name}: warm wrote {warmed['writes']} values in {warmed['write_round_trips']} "
            f"round trips (before batching: 2 per value, {2 * warmed['writes']}); a request "
            f"after the lookups: {check['passages_hit']} passages hit, "
            f"{check['passages_missed']} encoded"
        )
    spread = ", ".join(map(str, result["keys_per_master"].values()))
    lines.append(f"keys per cluster master: {spread}")
    warmed = result["topologies"]["3-node cluster"]["warm"]
    empty = sum(result["empty_used_memory_per_master"].values())
    data = sum(result["used_memory_per_master"].values()) - empty
    lines.append(
        f"sizing: {warmed['written_bytes'] / warmed['passage_tokens']:.0f} bytes per passage "
        f"token as stored (KV, token ids, header; the head's exact blocks included); the "
        f"masters' used_memory grew {data / warmed['passage_tokens']:.0f} per token "
        f"({data / 2**20:.1f} MiB over {empty / 2**20:.1f} MiB empty)"
    )
    lines.append(
        f"{RTT_NAME}: every flight crosses a loopback proxy holding each chunk "
        f"{DELAY_S * 1e3:.1f} ms each way (bench.fault_server.DelayedLink)"
    )
    return "\n".join(lines)


def run(base: KVBoost, folder: Path, count: int, pool_tokens: int) -> dict[str, Any]:
    pool = passages(base.tokenizer, pool_tokens, PER_PROMPT * (count + 1))
    prompts = [pool[i : i + PER_PROMPT] for i in range(0, len(pool), PER_PROMPT)]
    topologies: dict[str, Any] = {}
    (folder / "server").mkdir(parents=True)
    with RedisProcess(folder / "server") as server:
        one = topologies["one server"] = {"warm": warm(base, server.url, pool)}
        one["loopback"] = measure(base, server.url, prompts)
        link = DelayedLink(server.port, DELAY_S)
        try:
            one[RTT_NAME] = measure(base, f"redis://127.0.0.1:{link.port}/0", prompts)
        finally:
            link.close()
        version = server.client().info("server")["redis_version"]
    with ClusterProcess(folder / "cluster", masters=3) as cluster:
        empty = _used_memory(cluster)
        three = topologies["3-node cluster"] = {"warm": warm(base, cluster.url, pool)}
        three["loopback"] = measure(base, cluster.url, prompts)
        three[RTT_NAME] = measure(base, cluster.behind_links(DELAY_S), prompts)
        spread = cluster.keys_per_master(b"kvboost:*:[0-9a-f]*")  # values, not the catalogue
        memory = _used_memory(cluster)
    return {
        "model": "smollm2-135m-instruct",
        "machine": machine(base),
        "redis": version,
        "requests": count,
        "delay_ms_each_way": DELAY_S * 1e3,
        "prompt_tokens": statistics.median(len(base.tokenize(prompt(p))) for p in prompts),
        "keys_per_master": {str(port): n for port, n in spread.items()},
        "used_memory_per_master": {str(port): n for port, n in memory.items()},
        "empty_used_memory_per_master": {str(port): n for port, n in empty.items()},
        "topologies": topologies,
    }


def _used_memory(cluster: ClusterProcess) -> dict[int, int]:
    """Port -> INFO used_memory of each master."""
    return {
        n.port: int(cluster.client(n).info("memory")["used_memory"]) for n in cluster.primaries()
    }


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.cluster", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--quick", action="store_true", help="2 counted prompts, short passages")
    parser.add_argument(
        "--prompts", type=positive, default=None, help="counted prompts (default 12)"
    )
    parser.add_argument("--pool-tokens", type=positive, default=None, help="default 100 (quick 40)")
    parser.add_argument("--threads", type=positive, default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    count = args.prompts or (2 if args.quick else 12)
    base = KVBoost.from_pretrained()
    folder = Path(tempfile.mkdtemp(prefix="kvboost-cluster-"))
    try:
        result = run(base, folder, count, args.pool_tokens or (40 if args.quick else 100))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = table(result)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster.txt").write_text(text + "\n")
    (args.out / "cluster.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
