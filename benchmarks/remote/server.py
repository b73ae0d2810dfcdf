"""The Redis server a benchmark measures against: a private ``redis-server`` (free loopback
port, temp folder, nothing persisted) or one the caller names, the few server calls the
benchmark makes (memory used, dropping a namespace), and waiting out an engine's writes."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.redis_server import RedisProcess
from kvboost_rag.core.store.remote import import_redis


def local_redis() -> RedisProcess:
    """A private server in a temp folder, started (the fault benchmark's ``RedisProcess``;
    ``kill()`` stops it)."""
    if shutil.which("redis-server") is None:
        raise RuntimeError(
            "redis-server is not installed (scripts/setup.sh installs it): install it, "
            "or pass --remote-url of a running server"
        )
    return RedisProcess(Path(tempfile.mkdtemp(prefix="kvboost-redis-"))).start()


def client(url: str) -> Any:
    return import_redis().Redis.from_url(url, socket_timeout=30)


def used_memory(url: str) -> int:
    """Bytes the server holds (``INFO memory``'s ``used_memory``)."""
    return int(client(url).info("memory")["used_memory"])


def drop(url: str, namespace: str) -> int:
    """Remove every key under ``namespace``; returns how many. DEL, not UNLINK: the memory
    is free when this returns, so the next ``used_memory`` reading is not inflated."""
    redis = client(url)
    names = list(redis.scan_iter(match=f"{namespace}:*", count=1000))
    for i in range(0, len(names), 1000):
        redis.delete(*names[i : i + 1000])
    return len(names)


def settle(engine: Any) -> Any:
    """``engine`` once its queued disk and Redis writes are made. Timed requests start
    settled, so a TTFT measures the tier it reads from, not the previous request's
    write-through still running beside it (reported apart, as bytes written)."""
    engine.flush()
    return engine


def server_version(url: str) -> str:
    return str(client(url).info("server")["redis_version"])
