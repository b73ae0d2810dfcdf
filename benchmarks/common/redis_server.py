"""A private ``redis-server`` the fault benchmark breaks on purpose: started on a loopback
port in a temp folder with nothing persisted, killed (SIGKILL), frozen (SIGSTOP: every
command hangs, as on a slow or stuck server), thawed, and started again empty on the same
port (a restart); and a slow link to it (``Trickle``: answers arrive a chunk at a time) or
a distant one (``DelayedLink``: every chunk arrives late, at full speed)."""

from __future__ import annotations

import contextlib
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from kvboost_rag.core.store.remote import import_redis

START_SECONDS = 10.0  # how long a server may take to answer PING


def free_port() -> int:
    """A loopback port nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dead_url() -> str:
    """The URL of a server that is not there."""
    return f"redis://127.0.0.1:{free_port()}/0"


class RedisProcess:
    """One server process on a fixed port; ``start()`` again after ``kill()`` restarts it."""

    def __init__(self, folder: Path, *args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
        self.binary = binary
        self.folder = folder
        self.args = args  # extra server options: --maxmemory 8mb ...
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        assert self.process is None, "already running"
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--dir", str(self.folder), "--save", "", "--appendonly", "no", *self.args]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if _pong(self.port):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: the server is gone at once, whatever it was doing."""
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)  # a frozen process dies too, but reap it
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, answers never come."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def client(self) -> Any:
        """A client of our own (not the engine's), patient enough for large values."""
        return import_redis().Redis.from_url(self.url, socket_timeout=30)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


class Trickle:
    """A loopback proxy to ``port`` that passes requests at once and answers at
    ``chunk / delay`` bytes per second, a chunk at a time: each read gets bytes well
    within any timeout, a whole multi-MB value takes seconds (a congested link)."""

    def __init__(self, port: int, chunk: int = 64 * 1024, delay: float = 0.05) -> None:
        self.target, self.chunk, self.delay = port, chunk, delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._open: list[socket.socket] = []
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="trickle", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._listener.close()
        for end in self._open:  # shutdown wakes the pipe threads blocked on them
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return  # closed
            self._open += [client, server]
            for src, dst, delay in ((client, server, 0.0), (server, client, self.delay)):
                args = (src, dst, self.chunk, delay)
                threading.Thread(target=_pipe, args=args, daemon=True).start()


class DelayedLink:
    """A loopback proxy to ``port`` that forwards every chunk ``delay`` seconds after it
    arrived, each way and in order: a network's latency (a round trip costs ``2 * delay``)
    without its bandwidth limit."""

    def __init__(self, port: int, delay: float) -> None:
        self.target, self.delay = port, delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._open: list[socket.socket] = []
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="delayed-link", daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        for end in self._open:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return  # closed
            for end in (client, server):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._open += [client, server]
            for src, dst in ((client, server), (server, client)):
                chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=_receive, args=(src, chunks), daemon=True).start()
                args = (dst, chunks, self.delay)
                threading.Thread(target=_forward, args=args, daemon=True).start()


def _receive(src: socket.socket, chunks: queue.Queue[tuple[float, bytes]]) -> None:
    try:
        while data := src.recv(256 * 1024):
            chunks.put((time.monotonic(), data))
    except OSError:
        pass
    chunks.put((time.monotonic(), b""))  # the end


def _forward(dst: socket.socket, chunks: queue.Queue[tuple[float, bytes]], delay: float) -> None:
    try:
        while data := _due(chunks, delay):
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_RDWR)


def _due(chunks: queue.Queue[tuple[float, bytes]], delay: float) -> bytes:
    """The next chunk, once ``delay`` has passed since it arrived."""
    arrived, data = chunks.get()
    time.sleep(max(0.0, arrived + delay - time.monotonic()))
    return data


def _pipe(src: socket.socket, dst: socket.socket, chunk: int, delay: float) -> None:
    try:
        while data := src.recv(chunk):
            dst.sendall(data)
            time.sleep(delay)
    except OSError:
        pass
    finally:
        for end in (src, dst):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
