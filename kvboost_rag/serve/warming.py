"""``POST /v1/kvboost/warm``: preload documents' passage KV through the server's engine.

The warm runs in a worker thread (it encodes on the model, which blocks), so the event loop
keeps answering. It is idempotent: documents already cached are counted ``cached``, not
encoded again. Streamed (``"stream": true``), the answer is newline-delimited JSON: a
``kvboost.warm.progress`` line as each batch of passages is encoded, then the
``kvboost.warm`` summary (or an ``{"error": ...}`` line: the status was sent already). A
warm refused before its first line (a bad prefix, a document over the context window) is
answered with its status, as unstreamed: the response starts with that first line.

A client that leaves does not stop a warm: what it encoded is cached for the next one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.results import WarmResult
from kvboost_rag.integrations._common import in_thread
from kvboost_rag.serve.errors import engine_error, error_body
from kvboost_rag.serve.schemas import WarmRequest
from kvboost_rag.warm import EnginePrefix, chat_prefix

__all__ = ["NDJSON", "progress_lines", "started", "warm", "warm_body"]

NDJSON = "application/x-ndjson"
Progress = Callable[[int], None]


def engine_prefix(body: WarmRequest) -> EnginePrefix:
    """The request's layout as ``engine.warm_passages(prefix=)`` takes it."""
    if body.system is not None:
        return chat_prefix(body.system)
    if isinstance(body.prefix, list):
        return [message.model_dump() for message in body.prefix]
    return body.prefix


async def warm(engine: KVBoost, body: WarmRequest, progress: Progress | None = None) -> WarmResult:
    """Warm ``body.documents`` off the event loop; ``progress`` gets the pieces each batch
    encoded, on the warm's thread. Errors name each document as ``documents[i]``."""
    names = [f"documents[{i}]" for i in range(len(body.documents))]
    return await in_thread(
        engine.warm_passages,
        body.documents,
        prefix=engine_prefix(body),
        batch_size=body.batch_size,
        progress=progress,
        names=names,
    )


def warm_body(result: WarmResult) -> dict[str, Any]:
    """The summary a warm answers with: the ``WarmResult``'s counts."""
    return {
        "object": "kvboost.warm",
        "documents": result.documents,
        "units": result.units,
        "tokens": result.tokens,
        "cached": result.cached,
        "new": result.new,
        "bytes": result.bytes,
        "skipped": result.skipped,
        "dropped": result.dropped,
        "failed": list(result.failed),
        "pieces": list(result.pieces),
        "seconds": round(result.seconds, 3),
    }


async def started(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """``lines`` once the first is ready; what it raised before that is raised here."""
    first = await anext(lines)

    async def again() -> AsyncIterator[str]:
        yield first
        async for line in lines:
            yield line

    return again()


async def progress_lines(engine: KVBoost, body: WarmRequest) -> AsyncIterator[str]:
    """The streamed answer's lines: progress as the warm's thread reports it, then the
    summary or the error; an error before the first line is raised."""
    loop = asyncio.get_running_loop()
    counts: asyncio.Queue[int] = asyncio.Queue()

    def report(encoded: int) -> None:  # on the warm's thread
        loop.call_soon_threadsafe(counts.put_nowait, encoded)

    task = asyncio.ensure_future(warm(engine, body, report))
    done, lines = 0, 0
    while not task.done() or not counts.empty():
        getter = asyncio.ensure_future(counts.get())
        await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            continue
        done += getter.result()
        lines += 1
        yield _line({"object": "kvboost.warm.progress", "encoded": done})
    error = task.exception()
    if error is not None and not lines:
        raise error
    if error is not None:
        refusal = engine_error(error)
        yield _line(error_body(refusal.status, refusal.message, refusal.code, refusal.param))
        return
    yield _line(warm_body(task.result()))


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload) + "\n"
