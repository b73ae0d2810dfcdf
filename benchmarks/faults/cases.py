"""The faults ``bench.faults`` inflicts on the shared Redis tier, one function each: it
starts its server(s) through the ``Watch``, breaks them while an engine warms into or
serves from them, and notes what it checked."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from benchmarks.common.redis_server import RedisProcess, Trickle, dead_url
from benchmarks.faults.lab import Lab
from benchmarks.faults.values import damaged, damaged_field, two_writers
from benchmarks.faults.watch import Watch
from kvboost_rag import KVBoost

PAUSE_S = 4.0  # how long the "slow" server stays frozen
KILL_AT = 1 / 3  # share of the corpus stored when the server is killed mid-warm
MEMORY_SHARE = 0.6  # maxmemory as a share of the corpus's values
TRICKLE_PROMPTS = 1  # prompts served over the slow link (each value takes seconds)


def control(lab: Lab, watch: Watch) -> None:
    """No fault: one engine warms, a fresh one serves every passage from Redis."""
    server = watch.server(lab)
    watch.warm(lab, watch.engine(lab, server.url))
    client = server.client()
    lab.golden = {name: client.get(name) for name in client.scan_iter(count=1000)}
    watch.note(lab.check_values(server))
    watch.serve(lab, watch.engine(lab, server.url), range(len(lab.queries)))


def down(lab: Lab, watch: Watch) -> None:
    """Nothing listens at the URL from the start; a fresh engine serves (cold)."""
    watch.serve(lab, watch.engine(lab, dead_url()), range(len(lab.queries)))


def killed_mid_warm(lab: Lab, watch: Watch) -> None:
    """SIGKILL once a third of the corpus is stored, while ``warm_corpus`` runs; the
    engine that warmed then serves."""
    server = watch.server(lab)
    engine = watch.engine(lab, server.url)
    done = threading.Event()
    stored: list[int] = []
    killer = threading.Thread(
        target=_kill_when, args=(server, len(lab.texts) * KILL_AT, done, stored)
    )
    killer.start()
    watch.warm(lab, engine)
    done.set()
    killer.join()
    watch.note(f"killed with {stored[0] if stored else 'all'} of {len(lab.texts)} values stored")
    watch.serve(lab, engine, range(len(lab.queries)))


def restarted(lab: Lab, watch: Watch) -> None:
    """Killed after half the prompts, started again empty on the same port."""
    server = watch.server(lab)
    lab.seed(server)
    engine = watch.engine(lab, server.url)
    half = len(lab.queries) // 2
    watch.serve(lab, engine, range(half))
    writes, errors = _writes(engine)
    server.kill()
    server.start()
    watch.serve(lab, engine, range(half, len(lab.queries)))
    keys = server.client().dbsize()
    writes_after, errors_after = _writes(engine)
    watch.note(
        f"before the restart {writes} writes, {errors} errors; after it {writes_after} "
        f"writes, {errors_after} errors; {keys} keys on the restarted server"
    )


def slow(lab: Lab, watch: Watch) -> None:
    """SIGSTOP for ``PAUSE_S`` from the second prompt on: every command times out."""
    server = watch.server(lab)
    lab.seed(server)
    engine = watch.engine(lab, server.url)
    watch.request(lab, engine, 0)
    server.pause()
    thaw = threading.Timer(PAUSE_S, server.resume)
    thaw.start()
    frozen = []
    for i in range(1, len(lab.queries)):
        paused = thaw.is_alive()
        result = watch.request(lab, engine, i)
        if paused and result is not None:
            frozen.append(result.ttft_ms)
    thaw.join()
    watch.note(
        f"{len(frozen)} requests started while frozen ({PAUSE_S:.0f} s), TTFT "
        + ", ".join(f"{t:.0f}" for t in frozen)
        + " ms"
    )


def slow_link(lab: Lab, watch: Watch) -> None:
    """Answers come through a link at 2.5 MiB/s: every read returns within the timeout,
    a whole value takes seconds."""
    server = watch.server(lab)
    lab.seed(server)
    link = Trickle(server.port, chunk=64 * 1024, delay=0.025)
    try:
        engine = watch.engine(lab, link.url)
        watch.serve(lab, engine, range(TRICKLE_PROMPTS))
        engine.flush()  # its writes go through the link too
    finally:
        link.close()
    rate = link.chunk / link.delay / 2**20
    watch.note(f"link {rate:.1f} MiB/s; values {_mean_mib(lab):.1f} MiB on average")


def flushed(lab: Lab, watch: Watch) -> None:
    """FLUSHALL between the warm and the requests."""
    server = watch.server(lab)
    lab.seed(server)
    server.client().flushall()
    watch.serve(lab, watch.engine(lab, server.url), range(len(lab.queries)))


def out_of_memory(lab: Lab, watch: Watch) -> None:
    """``maxmemory`` below the corpus with ``noeviction``: writes past it are refused."""
    _warm_then_serve(lab, watch, "noeviction")


def evicting(lab: Lab, watch: Watch) -> None:
    """``maxmemory`` below the corpus with ``allkeys-lru``: evicted keys are misses."""
    _warm_then_serve(lab, watch, "allkeys-lru")


def _warm_then_serve(lab: Lab, watch: Watch, policy: str) -> None:
    limit = int(MEMORY_SHARE * sum(map(len, lab.golden.values())) / 2**20)
    server = watch.server(lab, "--maxmemory", f"{limit}mb", "--maxmemory-policy", policy)
    watch.warm(lab, watch.engine(lab, server.url))
    client = server.client()
    stored = client.dbsize()
    watch.note(f"maxmemory {limit}mb: {stored} of {len(lab.texts)} values stored after the warm")
    watch.serve(lab, watch.engine(lab, server.url), range(len(lab.queries)))
    watch.engines[-1].flush()
    stats, memory = client.info("stats"), client.info("memory")
    watch.note(
        f"the server received {stats['total_net_input_bytes'] / 2**20:.0f} MiB in all, "
        f"holds {memory['used_memory'] / 2**20:.0f} MiB; evicted {stats['evicted_keys']} keys"
    )


def _kill_when(
    server: RedisProcess, count: float, done: threading.Event, stored: list[int]
) -> None:
    client = server.client()
    while not done.is_set():
        keys = client.dbsize()
        if keys >= count:
            server.kill()
            stored.append(keys)
            return
        time.sleep(0.01)


def _mean_mib(lab: Lab) -> float:
    return sum(map(len, lab.golden.values())) / max(len(lab.golden), 1) / 2**20


def _writes(engine: KVBoost) -> tuple[int, int]:
    """Shared-tier writes and errors so far, once queued writes are sent."""
    engine.flush()
    stats = engine.stats().remote
    assert stats is not None
    return stats.writes, stats.errors


CASES: list[tuple[str, Callable[[Lab, Watch], None]]] = [
    ("no fault (control)", control),
    ("server down at start", down),
    ("killed mid-warm", killed_mid_warm),
    ("restarted empty", restarted),
    ("slow (frozen 4 s)", slow),
    ("slow link (2.5 MiB/s)", slow_link),
    ("flushed", flushed),
    ("out of memory", out_of_memory),
    ("evicting (LRU)", evicting),
    ("damaged values", damaged),
    ("damaged 'layers' field", damaged_field),
    ("two writers at once", two_writers),
]
