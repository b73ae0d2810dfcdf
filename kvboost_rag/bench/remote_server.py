"""The Redis server a benchmark measures against: a private ``redis-server`` (free loopback
port, temp folder, nothing persisted) or one the caller names, the few server calls the
benchmark makes (memory used, dropping a namespace), and waiting out an engine's writes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

from kvboost_rag.core.remote import import_redis


class LocalRedis:
    """A private server, stopped by ``stop()`` (or as a context manager)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed (scripts/setup.sh installs it): install it, "
                "or pass --remote-url of a running server"
            )
        self.binary = binary
        self.folder = tempfile.mkdtemp(prefix="kvboost-redis-")
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--dir", self.folder, "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        errors = (OSError, import_redis().exceptions.RedisError)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if client(self.url).ping():
                    return self
            except errors:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within 10 s")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    engine._store.flush()
    return engine


def server_version(url: str) -> str:
    return str(client(url).info("server")["redis_version"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
