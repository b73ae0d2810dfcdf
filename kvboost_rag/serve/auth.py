"""API keys: with one configured, every /v1 request and /metrics carry
``Authorization: Bearer <key>``.

Checked in ASGI middleware, before the body is read or parsed: a client without the key
learns nothing about what the server would make of its request (not even a 400)."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from kvboost_rag.serve.errors import error_body

__all__ = ["BearerAuth"]

# /health stays open: load balancers probe it without credentials. /metrics does not: its
# counts tell who is using the server how much.
PROTECTED = ("/v1/", "/metrics")


class BearerAuth:
    """ASGI middleware refusing (401) a protected request without ``key``. Compared in constant
    time, so response timing does not tell how much of a guess was right."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            problem = self._problem(dict(scope["headers"]).get(b"authorization", b""))
            if problem is not None:
                await _refuse(send, problem)
                return
        await self.app(scope, receive, send)

    def _problem(self, header: bytes) -> str | None:
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return "no API key: send the header 'Authorization: Bearer <key>'"
        if not hmac.compare_digest(given.strip(), self.key):
            return "the API key is not valid"
        return None


async def _refuse(send: Send, message: str) -> None:
    body = json.dumps(error_body(401, message, code="invalid_api_key")).encode()
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
