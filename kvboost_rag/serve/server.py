"""Running the app: in the foreground (``kvboost-rag serve``), or on a thread of this
process for as long as a ``with`` block lasts (notebooks, scripts, tests)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.serve.app import create_app
from kvboost_rag.serve.settings import ServeSettings

__all__ = ["run", "serving"]


def _server(engine: KVBoost, settings: ServeSettings, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(engine, settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        # Shutdown waits this long for requests in flight, then cancels them (their
        # streams close, which cancels their requests in the engine).
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s)),
        server_header=False,
    )
    return uvicorn.Server(config)


def run(engine: KVBoost, settings: ServeSettings, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM, then shut down gracefully. Call from the main thread."""
    server = _server(engine, settings, log_level)
    # uvicorn raises the signal that stopped it again once it has shut down; SIGTERM's
    # default would then kill the process with it, and a service manager would read a clean
    # shutdown as a crash. SIGINT goes on to the CLI's handler (exit status 130).
    previous = signal.signal(signal.SIGTERM, _after_shutdown)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _after_shutdown(signum: int, frame: object) -> None:
    """SIGTERM after uvicorn's graceful shutdown: nothing is left to do."""


@contextmanager
def serving(
    engine: KVBoost, settings: ServeSettings | None = None, log_level: str = "warning"
) -> Iterator[str]:
    """Serve ``engine`` on a thread while the block runs; yields the base URL for OpenAI
    clients (``http://127.0.0.1:PORT/v1``). Port 0 (the default here) takes a free one."""
    settings = settings or ServeSettings(model_name=engine.name, port=0)
    server = _server(engine, settings, log_level)
    thread = threading.Thread(target=server.run, name="kvboost-serve", daemon=True)
    thread.start()
    try:
        yield f"http://{settings.host}:{_bound_port(server, thread)}/v1"
    finally:
        server.should_exit = True
        thread.join()


def _bound_port(server: uvicorn.Server, thread: threading.Thread) -> int:
    """The port the server listens on, once it does."""
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise OSError("the server did not start (its log says why)")
        time.sleep(0.02)
    return int(server.servers[0].sockets[0].getsockname()[1])
