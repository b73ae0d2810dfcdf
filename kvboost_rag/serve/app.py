"""The OpenAI-compatible HTTP app over one engine: routes, and the way a request is admitted,
run and answered. It translates HTTP into engine calls and holds no engine logic."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.integrations._common import in_thread
from kvboost_rag.serve.auth import BearerAuth
from kvboost_rag.serve.errors import APIError, add_handlers, engine_error
from kvboost_rag.serve.generation import Generation, Opener, RequestTimeout, open_generation
from kvboost_rag.serve.limits import Admission, BodyLimit
from kvboost_rag.serve.metrics import CONTENT_TYPE, Metrics, RequestCounter
from kvboost_rag.serve.responses import Reply, answer, events, timeout_error
from kvboost_rag.serve.schemas import ChatRequest, CompletionRequest, WarmRequest, _Sampling
from kvboost_rag.serve.settings import ServeSettings
from kvboost_rag.serve.translate import chat_openers, completion_openers
from kvboost_rag.serve.warming import NDJSON, progress_lines, started, warm, warm_body

__all__ = ["create_app"]

log = logging.getLogger("kvboost_rag.serve")
CLIENT_GONE = 499  # nginx's status for a client that left before its answer; nobody reads it


def create_app(engine: KVBoost, settings: ServeSettings) -> FastAPI:
    """The app serving ``engine`` as the model ``settings.model_name``."""
    app = FastAPI(
        title="kvboost-rag",
        lifespan=_lifespan(engine),
        docs_url=None,  # no pages of the API's own: the API is OpenAI's
        redoc_url=None,
        openapi_url=None,
    )
    add_handlers(app)
    admission = Admission(settings.max_queue, settings.retry_after_s)
    metrics = Metrics(engine, lambda: admission.active)
    runner = Runner(settings, admission, metrics)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.api_key is not None:  # added after, so it runs before: the body is unread
        app.add_middleware(BearerAuth, key=settings.api_key)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: counts refusals too
    card = {"id": settings.model_name, "object": "model", "created": int(time.time())}
    card["owned_by"] = "kvboost-rag"

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_name, "in_flight": runner.admission.active}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        runner.check_model(name)
        return card

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        reply = Reply("chat", settings.model_name, body.n, body.include_usage)
        return await runner.run(request, body, reply, lambda: chat_openers(engine, body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        reply = Reply("text", settings.model_name, body.n, body.include_usage)
        return await runner.run(request, body, reply, lambda: completion_openers(engine, body))

    @app.post("/v1/kvboost/warm")
    async def warm_documents(body: WarmRequest) -> Response:
        admission.enter()
        if body.stream:
            try:
                lines = await started(progress_lines(engine, body))
            except Exception as error:
                admission.leave()
                raise engine_error(error) from None
            return ClosingStream(lines, admission.leave, NDJSON)
        try:
            return JSONResponse(warm_body(await warm(engine, body)))
        except Exception as error:
            raise engine_error(error) from None
        finally:
            admission.leave()

    return app


def _lifespan(engine: KVBoost) -> Callable[[FastAPI], Any]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Shutdown: what finished requests left behind (passage encodes, disk and shared-tier
        # writes) is stored before the process ends.
        try:
            await in_thread(engine.flush)
        except OSError as error:
            log.error("writes pending at shutdown failed: %s", error)

    return lifespan


class Runner:
    """Admits a request, opens its streams and answers it, whole or streamed."""

    def __init__(self, settings: ServeSettings, admission: Admission, metrics: Metrics) -> None:
        self.settings = settings
        self.admission = admission
        self.metrics = metrics

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist here; this server serves "
                f"{self.settings.model_name!r}",
                code="model_not_found",
                param="model",
            )

    def check_answers(self, answers: int, n: int) -> None:
        limit = self.settings.max_answers
        if answers > limit:
            prompts = answers // n
            raise APIError(
                400,
                f"this request asks for {answers} answers ({prompts} prompt(s) x n={n}); this "
                f"server answers at most {limit} a request (kvboost-rag serve --max-answers)",
                code="invalid_value",
                param="n" if n > 1 else "prompt",
            )

    async def run(
        self,
        request: Request,
        body: _Sampling,
        reply: Reply,
        openers: Callable[[], list[Opener]],
    ) -> Response:
        self.check_model(body.model)
        self.admission.enter()
        try:
            opened = openers()
            self.check_answers(len(opened), body.n)
            generation = await open_generation(opened)
        except APIError:
            self.admission.leave()
            raise
        except Exception as error:
            self.admission.leave()
            raise engine_error(error, "messages" if reply.kind == "chat" else "prompt") from None
        deadline = asyncio.get_running_loop().time() + self.settings.request_timeout_s
        if body.stream:
            lines = events(reply, generation, deadline, self.settings.request_timeout_s)
            return ClosingStream(lines, lambda: self._finish(generation))
        try:
            return await self._whole(request, reply, generation, deadline)
        finally:
            self._finish(generation)

    def _finish(self, generation: Generation) -> None:
        # Before cancelling: the answers that finished are counted, a stream cut short is not.
        self.metrics.observe([s.result for s in generation.streams if s.result is not None])
        generation.cancel()  # a no-op for streams that ended
        self.admission.leave()

    async def _whole(
        self, request: Request, reply: Reply, generation: Generation, deadline: float
    ) -> Response:
        """The whole answer, or nothing once the client has left (its streams cancelled)."""
        collect = asyncio.ensure_future(_collect(generation, deadline))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
        if not collect.done() or collect.cancelled():
            return Response(status_code=CLIENT_GONE)
        error = collect.exception()
        if isinstance(error, RequestTimeout):
            raise timeout_error(self.settings.request_timeout_s)
        if error is not None:
            raise engine_error(error) from None
        return JSONResponse(answer(reply, generation.results))


async def _collect(generation: Generation, deadline: float) -> None:
    async for _ in generation.deltas(deadline):
        pass


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has closed its connection (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClosingStream(StreamingResponse):
    """A streamed response (SSE unless told) that runs ``on_close`` however it ends:
    finished, the client gone (Starlette cancels the body then), or never started."""

    def __init__(
        self,
        lines: AsyncIterator[str],
        on_close: Callable[[], None],
        media_type: str = "text/event-stream",
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(lines, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
