"""``/metrics`` in Prometheus text format: what requests cost and reused, and the queue.

One registry per app (not prometheus_client's global one), so two apps in one process
(the tests, ``serving`` beside ``kvboost-rag serve``) count apart. Token and passage counts
come from the engine's results; tier errors from ``engine.stats()`` when it is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.results import GenerationResult

__all__ = ["CONTENT_TYPE", "Metrics", "RequestCounter"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# TTFT on a CPU runs from tens of ms (all reused) to seconds (long prompts, a full queue).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Routes counted under their own path; anything else (404s, probes) is "other", so a
# scanner cannot grow the label set without bound.
ENDPOINTS = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/kvboost/warm",
    }
)


class Metrics:
    """The app's instruments, in a registry of its own."""

    def __init__(self, engine: KVBoost, in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "kvboost_time_to_first_token_seconds",
            "From a request reaching the engine to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "kvboost_time_per_output_token_seconds",
            "Decoding time per generated token after the first.",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "kvboost_requests",
            "HTTP requests answered.",
            labelnames=("endpoint", "status"),
            registry=self.registry,
        )
        self.tokens = Counter(
            "kvboost_tokens",
            "Tokens of finished answers: prompt, completion, and cached (prompt tokens "
            "whose KV was reused).",
            labelnames=("kind",),
            registry=self.registry,
        )
        self.passages = Counter(
            "kvboost_passages",
            "Passages of finished answers' prompts: hit (stored KV used), unused (stored, not "
            "used) or missed (not stored).",
            labelnames=("result",),
            registry=self.registry,
        )
        gauge = Gauge(
            "kvboost_requests_in_flight",
            "Requests admitted and not yet answered (the queue, up to --max-queue).",
            registry=self.registry,
        )
        gauge.set_function(in_flight)
        self.registry.register(_TierCollector(engine))

    def observe(self, results: Sequence[GenerationResult]) -> None:
        """Count the answers of one request (every answer of ``n``)."""
        for result in results:
            self.ttft.observe(result.ttft_ms / 1e3)
            if result.completion_tokens > 1:
                decode_s = (result.total_ms - result.ttft_ms) / 1e3
                self.tpot.observe(max(decode_s, 0.0) / (result.completion_tokens - 1))
            self.tokens.labels("prompt").inc(result.prompt_tokens)
            self.tokens.labels("completion").inc(result.completion_tokens)
            self.tokens.labels("cached").inc(result.reused_tokens)
            self.passages.labels("hit").inc(result.passages_hit)
            self.passages.labels("missed").inc(result.passages_missed)
            self.passages.labels("unused").inc(result.passages_unused)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TierCollector(Collector):
    """The storage tiers' failures as the engine counts them, read at each scrape: the
    shared tier's failed calls, and damaged entries found (and removed) on disk or in
    the shared tier. Tiers the engine does not have are left out."""

    def __init__(self, engine: KVBoost) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        errors = CounterMetricFamily(
            "kvboost_tier_errors",
            "Calls to a storage tier that failed (connection, timeout, an error answered).",
            labels=("tier",),
        )
        corrupt = CounterMetricFamily(
            "kvboost_tier_corrupt",
            "Entries found damaged or foreign in a storage tier, and removed.",
            labels=("tier",),
        )
        if stats.remote is not None:
            errors.add_metric(["remote"], stats.remote.errors)
            corrupt.add_metric(["remote"], stats.remote.corrupt)
        if stats.disk is not None:
            corrupt.add_metric(["disk"], stats.disk.corrupt)
        yield from (errors, corrupt)


class RequestCounter:
    """ASGI middleware counting every HTTP response by route and status, refusals made by
    the middleware after it (401, 413) included."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        if scope["path"].startswith("/v1/models/"):
            endpoint = "/v1/models"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
