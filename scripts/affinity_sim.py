"""Routing replicas that share one Redis tier, simulated: which tier each passage of each
request comes from under a router, and the time to first token that costs (measured by
``affinity_routing.py``, looked up by how many of the request's passages came from memory,
Redis or an encode). Pure Python, seeded, deterministic.

The workload: a corpus of ``passages`` passages in topics of ``topic_size``; a request
picks a topic by Zipf(s) popularity, then ``k`` distinct passages, each from its topic
(Zipf(s) by rank within it) with probability ``topical``, else from the whole corpus
(Zipf(s) over a shuffled order). The first passage is the retriever's top one. Every
replica keeps an LRU of ``memory`` passages; Redis holds the warmed corpus, or starts
empty (``warmed=False``: a passage no tier holds is encoded by the replica that needs it,
then kept by both). The first ``warmup`` share of requests fills the tiers, not counted.
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect, bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

Request = tuple[int, ...]  # passage ids, the retriever's top passage first
Costs = dict[tuple[int, int, int], float]  # (memory, redis, encoded) -> TTFT ms


@dataclass(frozen=True)
class Workload:
    passages: int = 10_000  # the corpus
    topic_size: int = 25  # passages per topic
    k: int = 4  # passages per request
    zipf: float = 1.0  # s of the topic, in-topic and corpus popularity
    topical: float = 0.8  # chance a passage comes from the request's topic
    requests: int = 40_000
    warmup: float = 0.25  # share of the requests not counted (they fill the tiers)
    seed: int = 0
    # Redis holds the whole corpus from the start (warmed, as the server guide says); else
    # it starts empty and a passage no tier holds is encoded by the replica that needs it
    warmed: bool = True


def zipf_sampler(n: int, s: float, rng: random.Random) -> Callable[[], int]:
    """Draws rank i in [0, n) with probability proportional to 1 / (i + 1)^s."""
    cumulative = list(accumulate(1.0 / (i + 1) ** s for i in range(n)))
    total = cumulative[-1]
    return lambda: min(n - 1, bisect(cumulative, rng.random() * total))


def requests(w: Workload) -> list[Request]:
    assert w.topic_size >= w.k and w.passages % w.topic_size == 0
    rng = random.Random(w.seed)
    topic = zipf_sampler(w.passages // w.topic_size, w.zipf, rng)
    within = zipf_sampler(w.topic_size, w.zipf, rng)
    anywhere = zipf_sampler(w.passages, w.zipf, rng)
    order = list(range(w.passages))
    rng.shuffle(order)  # the corpus's popular passages are spread over its topics
    out = []
    for _ in range(w.requests):
        t, chosen = topic(), list[int]()
        while len(chosen) < w.k:
            p = t * w.topic_size + within() if rng.random() < w.topical else order[anywhere()]
            if p not in chosen:
                chosen.append(p)
        out.append(tuple(chosen))
    return out


def digest(name: str) -> int:
    """A router's hash of ``name`` (an application would send a passage's or a document's
    id, or a digest of the passage's text: any stable string)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


class Ring:
    """A consistent-hash ring with ``points`` virtual nodes per replica (ketama)."""

    def __init__(self, replicas: int, points: int = 160) -> None:
        marks = []
        for r in range(replicas):
            for v in range(points):
                marks.append((digest(f"replica:{r}:{v}"), r))
        marks.sort()
        self.hashes = [h for h, _ in marks]
        self.owners = [r for _, r in marks]

    def walk(self, key: int) -> list[int]:
        """The replicas in ring order from ``key``'s point, each once."""
        start, seen = bisect_left(self.hashes, key), dict[int, None]()
        for i in range(len(self.owners)):
            seen.setdefault(self.owners[(start + i) % len(self.owners)])
        return list(seen)


class Router:
    """Picks a replica per request; ``inflight`` requests stay in flight after theirs (a
    window of the latest arrivals: each replica serves ``concurrency`` at once on average)."""

    def __init__(self, replicas: int, concurrency: int) -> None:
        self.replicas = replicas
        self.window: deque[int] = deque(maxlen=concurrency * replicas)
        self.load = [0] * replicas

    def route(self, request: Request) -> int:
        if len(self.window) == self.window.maxlen:
            self.load[self.window[0]] -= 1
        r = self.pick(request)
        self.window.append(r)
        self.load[r] += 1
        return r

    def pick(self, request: Request) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    def __init__(self, replicas: int, concurrency: int) -> None:
        super().__init__(replicas, concurrency)
        self.n = 0

    def pick(self, request: Request) -> int:
        self.n += 1
        return self.n % self.replicas


class Random(Router):
    def __init__(self, replicas: int, concurrency: int, seed: int = 1) -> None:
        super().__init__(replicas, concurrency)
        self.rng = random.Random(seed)

    def pick(self, request: Request) -> int:
        return self.rng.randrange(self.replicas)


class Hashed(Router):
    """Consistent hashing on ``key(request)``. With ``bound``, a replica takes a request
    only while its in-flight load stays within ``bound`` x the mean (consistent hashing
    with bounded loads, Mirrokni et al.; HAProxy's ``hash-balance-factor``, Envoy's
    ``hash_balance_factor``); the next replica on the ring takes the rest."""

    def __init__(
        self, replicas: int, concurrency: int, key: Callable[[Request], int], bound: float = 0
    ) -> None:
        super().__init__(replicas, concurrency)
        self.ring, self.key, self.bound = Ring(replicas), key, bound

    def pick(self, request: Request) -> int:
        order = self.ring.walk(self.key(request))
        if not self.bound:
            return order[0]
        cap = math.ceil(self.bound * (sum(self.load) + 1) / self.replicas)
        return next((r for r in order if self.load[r] + 1 <= cap), order[0])


def routers(topic_size: int) -> dict[str, Callable[[int, int], Router]]:
    """The routers compared, by name: what a plain load balancer does, and consistent
    hashing on keys an application can send (its top passage; the least hash of its
    passages, a min-hash that requests sharing most passages share; the document its
    top passage comes from, a topic here)."""

    def top(request: Request) -> int:
        return digest(f"passage:{request[0]}")

    def least(request: Request) -> int:
        return min(digest(f"passage:{p}") for p in request)

    def document(request: Request) -> int:
        return digest(f"document:{request[0] // topic_size}")

    return {
        "round-robin": RoundRobin,
        "random": Random,
        "hash top passage": lambda r, c: Hashed(r, c, top),
        "hash min passage": lambda r, c: Hashed(r, c, least),
        "hash top document": lambda r, c: Hashed(r, c, document),
        "hash top document, bounded 1.25": lambda r, c: Hashed(r, c, document, 1.25),
    }


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


@dataclass(frozen=True)
class Memory:
    """A replica's memory tier, in passages' KV: an LRU of ``size`` of them, where each
    request also leaves its prompt's KV (``cache_generated``), ``prompt`` passages' worth,
    never reused by another request (each asks its own question)."""

    size: float
    prompt: float = 0.0


def simulate(
    stream: list[Request], router: Router, memory: Memory, costs: Costs, w: Workload
) -> dict[str, Any]:
    """Routes ``stream``; the tiers each counted request's passages came from, its TTFT
    estimate (``costs`` of its mix) and each replica's share of the counted requests."""
    memories = [OrderedDict[Any, float]() for _ in range(router.replicas)]
    held_size = [0.0] * router.replicas
    redis = set(range(w.passages)) if w.warmed else set[int]()
    warmup = int(w.warmup * w.requests)
    tiers, ttft, served = [0, 0, 0], list[float](), [0] * router.replicas
    for i, request in enumerate(stream):
        r = router.route(request)
        held, mix = memories[r], [0, 0, 0]
        for p in request:
            mix[0 if p in held else 1 if p in redis else 2] += 1
            if p in held:
                held.move_to_end(p)
            else:
                held[p], held_size[r] = 1.0, held_size[r] + 1.0
            redis.add(p)
        if memory.prompt:  # its key, -1 - i, is no passage's
            held[-1 - i], held_size[r] = memory.prompt, held_size[r] + memory.prompt
        while held_size[r] > memory.size:
            held_size[r] -= held.popitem(last=False)[1]
        if i >= warmup:
            tiers = [a + b for a, b in zip(tiers, mix)]
            ttft.append(costs[(mix[0], mix[1], mix[2])])
            served[r] += 1
    uses = sum(tiers)
    return {
        "memory_share": tiers[0] / uses,
        "redis_share": tiers[1] / uses,
        "encode_share": tiers[2] / uses,
        "ttft_mean_ms": sum(ttft) / len(ttft),
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "imbalance": max(served) * len(served) / sum(served),
    }


def compare(
    w: Workload, replicas: Sequence[int], memory: Memory, costs: Costs, concurrency: int = 4
) -> list[dict[str, Any]]:
    """Every router at every replica count on one request stream, and a reference: one
    replica with all the replicas' memory (what perfect partitioning could reach)."""
    stream, rows = requests(w), []
    redis = "warmed" if w.warmed else "empty"
    for count in replicas:
        for name, make in routers(w.topic_size).items():
            row = simulate(stream, make(count, concurrency), memory, costs, w)
            rows.append({"redis": redis, "zipf": w.zipf, "replicas": count, "router": name, **row})
        one = Memory(count * memory.size, memory.prompt)
        pooled = simulate(stream, RoundRobin(1, concurrency), one, costs, w)
        rows.append({"redis": redis, "zipf": w.zipf, "replicas": count} | pooled)
        rows[-1]["router"] = "pooled memory (reference)"
    return rows
