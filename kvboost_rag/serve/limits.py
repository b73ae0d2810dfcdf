"""What the server admits: bodies up to a size, and a bounded number of requests in flight."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvboost_rag.serve.errors import APIError, error_body

__all__ = ["Admission", "BodyLimit"]


class BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes is answered 413 before any of it is
    parsed, whether its Content-Length says so or its chunks add up to it. The body read
    here is handed on whole; the client's later messages (a disconnect) pass through."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        body = await self._read(receive)
        if body is None:
            await self._refuse(send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit (or the client left)."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return None
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, send: Send) -> None:
        message = f"the request body is over the server's limit of {self.limit} bytes"
        body = json.dumps(error_body(413, message, code="request_too_large")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class Admission:
    """Requests in flight, at most ``limit``: the one past it is refused with 429 and a
    ``Retry-After``. Used on the event loop's thread only, so it needs no lock."""

    def __init__(self, limit: int, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.active = 0

    def enter(self) -> None:
        if self.active >= self.limit:
            raise APIError(
                429,
                f"the server has {self.active} requests in flight, its limit; retry shortly",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.active += 1

    def leave(self) -> None:
        assert self.active > 0, "left more often than entered"
        self.active -= 1
