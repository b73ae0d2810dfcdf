"""A private ``redis-server`` for tests: started on a free loopback port in a temp folder,
stopped (or killed, restarted, paused) by the test. The real server, not a mock: the
shared tier's behaviour under eviction, faults and concurrent writers is the server's."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def require_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        why = "redis-server is not installed (scripts/setup.sh installs Debian's redis-server)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, folder: Path, *args: str) -> None:
        self.binary = require_binary()
        self.folder = folder
        self.port = free_port()
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir"]
        cmd += [str(self.folder), "--save", "", "--appendonly", "no", *self.args]
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.folder / "redis.log"
        with log.open("ab") as out:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}: {log.read_text()}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang, as on a slow or stuck server."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis.from_url(self.url)
