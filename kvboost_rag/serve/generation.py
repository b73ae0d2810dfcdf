"""The engine's streams behind one HTTP request, read from the event loop.

Every request, streamed or not, runs as ``GenerationStream``s (one per answer asked for):
the engine's executor decodes them with every other request in flight, and a stream can be
closed, which cancels its request. That is what a client that disconnects, a timeout and
shutdown need; ``chat`` / ``generate`` would block a thread to the end of the answer.

Engine calls block, so none runs on the event loop: opening a stream (tokenizing, tier
reads) runs in a worker thread, and each stream is drained by a thread of its own into an
``asyncio.Queue`` that the request's handler reads with its deadline.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence

from kvboost_rag.core.generation.streaming import GenerationStream
from kvboost_rag.core.results import GenerationResult
from kvboost_rag.integrations._common import in_thread

__all__ = ["Generation", "RequestTimeout", "open_generation"]

Opener = Callable[[], GenerationStream]
_END = object()


class RequestTimeout(Exception):
    """The request ran past ``ServeSettings.request_timeout_s``; its streams are closed."""


async def open_generation(openers: Sequence[Opener]) -> Generation:
    """Open every stream (in worker threads); an engine error opening one (a bad request)
    closes those already open and propagates."""
    streams: list[GenerationStream] = []
    try:
        for opener in openers:
            streams.append(await in_thread(opener))
    except BaseException:
        Generation(streams).cancel()
        raise
    return Generation(streams)


class Generation:
    """The streams answering one request, drained concurrently into the event loop."""

    def __init__(self, streams: Sequence[GenerationStream]) -> None:
        self.streams = list(streams)
        self._started = False

    @property
    def results(self) -> list[GenerationResult]:
        """Each stream's result; only once ``deltas`` has ended."""
        results = [stream.result for stream in self.streams]
        assert all(r is not None for r in results), "read results after the streams ended"
        return [r for r in results if r is not None]

    async def deltas(self, deadline: float) -> AsyncIterator[tuple[int, str]]:
        """``(answer index, text delta)`` as the executor decodes them, until every stream
        has ended. Raises ``RequestTimeout`` at ``deadline`` (the loop's clock) and what a
        stream raised; either way the streams still running are cancelled."""
        assert not self._started, "a generation is read once"
        self._started = True
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        for index, stream in enumerate(self.streams):
            _drain_in_thread(index, stream, loop, queue)
        live = len(self.streams)
        try:
            while live:
                index, item = await _next(queue, deadline - loop.time())
                if item is _END:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    assert isinstance(item, str)
                    yield index, item
        finally:
            if live:
                self.cancel()

    def cancel(self) -> None:
        """Cancel the streams still running, without waiting for them to end: this may run
        where the event loop must not block, or where awaiting is itself being cancelled."""
        running = [s for s in self.streams if s.result is None]

        def close() -> None:
            for stream in running:
                stream.close()

        if running:
            threading.Thread(target=close, name="kvboost-cancel", daemon=True).start()


async def _next(queue: asyncio.Queue[tuple[int, object]], timeout: float) -> tuple[int, object]:
    if timeout <= 0:
        raise RequestTimeout
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except asyncio.TimeoutError:
        raise RequestTimeout from None


def _drain_in_thread(
    index: int,
    stream: GenerationStream,
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue[tuple[int, object]],
) -> None:
    """Iterate ``stream`` on a daemon thread, handing each delta, then ``_END`` or the
    error it raised, to ``queue`` on ``loop``."""

    def hand(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (index, item))
        except RuntimeError:  # the loop is closed: nobody reads this request any more
            pass

    def drain() -> None:
        try:
            for delta in stream:
                hand(delta)
        except BaseException as error:  # the handler raises it where it reads the queue
            hand(error)
            return
        hand(_END)

    threading.Thread(target=drain, name="kvboost-serve-stream", daemon=True).start()
