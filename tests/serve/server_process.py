"""A real ``kvboost-rag serve`` process on a free loopback port, for the tests that talk to
it over HTTP; stopped (SIGTERM, then SIGKILL) when its ``with`` block ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from types import TracebackType

import httpx
from redis_server import free_port

__all__ = ["ServerProcess"]


class ServerProcess:
    def __init__(self, *args: str, start_timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.args = ["serve", *args, "--port", str(self.port), "--log-level", "warning"]
        self.start_timeout_s = start_timeout_s
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/v1"  # an OpenAI client's base_url
        self._log = tempfile.TemporaryFile(mode="w+")
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServerProcess:
        command = [sys.executable, "-m", "kvboost_rag.cli", *self.args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("KVBOOST_API_KEY", None)  # the tests say which key the server has
        self._process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env
        )
        self._wait_until_healthy()
        return self

    def _wait_until_healthy(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the server exited ({self._process.returncode}):\n{self.log}")
            try:
                if httpx.get(f"{self.root}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not answer /health in time:\n{self.log}")

    @property
    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as a crashed or preempted replica does."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self) -> int | None:
        """SIGTERM (a graceful shutdown), SIGKILL if it has not ended in 60 s; its status."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        return self._process.returncode

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
        self._log.close()
