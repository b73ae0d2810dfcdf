"""The faults ``bench.faults --cluster`` inflicts on a shared tier that is a Redis Cluster
of 3 masters (``cluster_server``): a master killed with no replica, a master killed with a
replica to fail over to, slots migrating between masters while an engine serves, a master
out of memory. The control warms the cluster and keeps its values to seed the others."""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.common.cluster_server import ClusterProcess
from benchmarks.faults.lab import Lab
from benchmarks.faults.watch import Watch
from kvboost_rag.core.store.redis_client import import_redis

MEMORY_SHARE = 0.2  # maxmemory of the full master, as a share of the corpus's values


def control(lab: Lab, watch: Watch) -> None:
    """No fault: one engine warms the cluster, a fresh one serves every passage from it."""
    cluster = watch.cluster(lab)
    watch.warm(lab, watch.engine(lab, cluster.url))
    lab.golden = {}
    for master in cluster.primaries():
        client = master.client()
        lab.golden.update({name: client.get(name) for name in client.scan_iter(count=1000)})
        watch.note(f"master :{master.port}: {lab.check_values(master)}")
    watch.serve(lab, watch.engine(lab, cluster.url), range(len(lab.queries)))


def master_killed(lab: Lab, watch: Watch, *args: str) -> None:
    """SIGKILL a master (no replica) after half the prompts: its keys are misses. Once
    the others agree it failed (cluster-node-timeout), they answer CLUSTERDOWN for every
    key too, unless ``cluster-require-full-coverage no`` (``partial``)."""
    cluster = _seeded(lab, watch, 0, *args)
    engine = watch.engine(lab, cluster.url)
    half = len(lab.queries) // 2
    watch.serve(lab, engine, range(half))
    victim = cluster.primaries()[0]
    victim.kill()
    before = engine.stats().remote
    watch.serve(lab, engine, range(half, len(lab.queries)))
    after = engine.stats().remote
    assert before is not None and after is not None
    watch.note(
        f"master :{victim.port} killed after {half} prompts; the shared tier then found "
        f"{after.hits - before.hits} entries and missed {after.misses - before.misses} "
        "(prefix blocks included)"
    )


def master_killed_partial(lab: Lab, watch: Watch) -> None:
    """As ``master_killed``, with ``cluster-require-full-coverage no``: the other masters
    go on serving their keys."""
    master_killed(lab, watch, "--cluster-require-full-coverage", "no")


def failover(lab: Lab, watch: Watch) -> None:
    """SIGKILL a master after the first prompt; its replica takes over once the others
    agree it failed (cluster-node-timeout 1 s). Every prompt is asked until it is served
    from the cluster again or 20 s passed."""
    cluster = _seeded(lab, watch, replicas=1)
    cluster.wait_until(cluster.synced, "the replicas to catch up")
    engine = watch.engine(lab, cluster.url)
    watch.request(lab, engine, 0)
    cluster.primaries()[0].kill()
    killed, served_at = time.monotonic(), None
    for i in range(1, len(lab.queries)):
        result = watch.request(lab, engine, i)
        while served_at is None and result is not None and result.passages_missed:
            if time.monotonic() - killed > 20:
                break
            time.sleep(0.2)
            engine.clear_cache()
            result = watch.request(lab, engine, i)
        if served_at is None and result is not None and not result.passages_missed:
            served_at = time.monotonic() - killed
    when = "never" if served_at is None else f"{served_at:.1f} s after the kill"
    watch.note(f"every passage served from the cluster again {when}")


def slots_migrating(lab: Lab, watch: Watch) -> None:
    """After the first prompt (the engine knows the layout), the slot of a passage each
    later prompt is the first to use moves to another master: for odd prompts halfway
    (its keys moved, the slot still the old master's: ASK), for even ones whole (MOVED)."""
    cluster = _seeded(lab, watch)
    engine = watch.engine(lab, cluster.url)
    watch.request(lab, engine, 0)
    sources, seen = [], set(lab.queries[0].passages)
    for i, query in enumerate(lab.queries[1:], 1):
        new = [text for text in query.passages if text not in seen]  # not in memory yet
        seen.update(query.passages)
        if not new:
            continue
        slot = cluster.slot(lab.passage_name(new[0]))
        source = cluster.owner(slot)
        target = next(m for m in cluster.primaries() if m is not source)
        cluster.start_migrating(slot, target, share=1.0)
        if i % 2 == 0:
            cluster.finish_migrating(slot, target)
        sources.append(source)
    watch.serve(lab, engine, range(1, len(lab.queries)))
    ask = sum(_errors(cluster, node, "ASK") for node in set(sources))
    moved = sum(_errors(cluster, node, "MOVED") for node in set(sources))
    watch.note(f"{len(sources)} slots migrating; the old masters answered {ask} ASK, {moved} MOVED")


def master_out_of_memory(lab: Lab, watch: Watch) -> None:
    """One master's ``maxmemory`` below its share of the corpus, with ``noeviction``: its
    writes past it are refused, the other masters take theirs."""
    cluster = watch.cluster(lab)
    full = cluster.primaries()[0]
    limit = int(MEMORY_SHARE * sum(map(len, lab.golden.values())) / 2**20) or 1
    full.client().config_set("maxmemory", f"{limit}mb")
    full.client().config_set("maxmemory-policy", "noeviction")
    watch.warm(lab, watch.engine(lab, cluster.url))
    spread = cluster.keys_per_master()
    watch.note(f"master :{full.port} maxmemory {limit}mb; keys per master after the warm {spread}")
    watch.serve(lab, watch.engine(lab, cluster.url), range(len(lab.queries)))


def _seeded(lab: Lab, watch: Watch, replicas: int = 0, *args: str) -> ClusterProcess:
    """A cluster holding the control's values (a warm without the encoding)."""
    cluster = watch.cluster(lab, replicas, *args)
    node = cluster.nodes[0]
    client = import_redis().cluster.RedisCluster(host="127.0.0.1", port=node.port)
    pipe = client.pipeline(transaction=False)
    for name, data in lab.golden.items():
        pipe.set(name, data)
    pipe.execute()
    client.close()
    return cluster


def _errors(cluster: ClusterProcess, node: object, kind: str) -> int:
    stats = cluster.client(node).info("errorstats")  # type: ignore[arg-type]
    return int(stats.get(f"errorstat_{kind}", {}).get("count", 0))


CASES: list[tuple[str, Callable[[Lab, Watch], None]]] = [
    ("cluster: no fault", control),
    ("cluster: master killed", master_killed),
    ("cluster: killed, partial", master_killed_partial),
    ("cluster: failover", failover),
    ("cluster: slots migrating", slots_migrating),
    ("cluster: master OOM", master_out_of_memory),
]
