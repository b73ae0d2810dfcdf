"""Every refusal in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with OpenAI's status codes; never a traceback in a response.

The engine's own ``ValueError`` / ``TypeError`` are what it raises for a request it cannot
take (a prompt over the context window, a chat template refusing the turns, a tool name
that is not there): 400 with its message. Anything else is the server's fault: 500 with a
fixed message, the traceback in the server's log only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvboost_rag.core.errors import ContextWindowError

__all__ = ["APIError", "add_handlers", "error_body"]

log = logging.getLogger("kvboost_rag.serve")

# OpenAI's error type for each status this server answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class APIError(Exception):
    """A refusal the app raises on purpose; the handler answers it in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.status, error.message, error.code, error.param)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def engine_error(error: BaseException, prompt: str | None = None) -> APIError:
    """An exception from an engine call, as what the client is told; ``prompt`` names the
    field a prompt over the context window came from (``messages``, ``prompt``)."""
    if isinstance(error, ContextWindowError):
        return APIError(400, str(error), code="context_length_exceeded", param=prompt)
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, str(error), code="invalid_value", param=param_of(str(error)))
    log.error("request failed", exc_info=error)
    return APIError(500, "the server failed to answer this request; see its log", code=None)


# The request fields an engine message may start by naming ("tools[0] parameters: ...",
# "tool_choice must be ...", "stop strings [...] cannot be written ...").
ENGINE_FIELDS = frozenset(
    {"messages", "prompt", "tools", "tool_choice", "parallel_tool_calls", "response_format"}
    | {"stop", "max_tokens", "temperature", "top_p", "seed", "n"}
)
NAMED = re.compile(r"(?P<field>[a-z_]+)(?:\[(?P<index>\d+)\])?")


def param_of(message: str) -> str | None:
    """The field an engine message names first, in OpenAI's ``param`` form (``tools.0``)."""
    named = NAMED.match(message)
    if named is None or named["field"] not in ENGINE_FIELDS:
        return None
    return named["field"] + (f".{named['index']}" if named["index"] else "")


def add_handlers(app: FastAPI) -> None:
    """Answer FastAPI's validation errors (its 422), unknown routes and every exception
    in OpenAI's shape."""

    async def api_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, APIError)
        return error_response(error)

    async def invalid(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        return error_response(validation_error(error.errors(), error.body))

    async def http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        if error.status_code == 400 and error.__cause__ is not None:  # FastAPI read no JSON
            return error_response(unreadable(error.__cause__))
        code = "not_found" if error.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(APIError(error.status_code, message, code=code))

    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return error_response(engine_error(error))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def unreadable(cause: BaseException) -> APIError:
    """A body FastAPI's JSON parser failed on with something other than a syntax error."""
    if isinstance(cause, RecursionError):
        said = "it nests too deeply to be read"
    elif isinstance(cause, UnicodeDecodeError):
        said = f"it is not UTF-8 ({cause.reason} at byte {cause.start})"
    else:  # a number of more than 4,300 digits, for one
        said = str(cause).split(";")[0]
    return APIError(400, f"the body is not valid JSON: {said}", code="json_invalid")


def validation_error(errors: Sequence[Any], body: Any = None) -> APIError:
    """Pydantic's most telling complaint as one line naming the field, in OpenAI's
    ``param`` form (``messages.0.role``)."""
    if not errors:
        return APIError(400, "invalid request body", code="invalid_value")
    first = max(errors, key=_telling)
    if first.get("type") == "json_invalid":
        where = f" at character {first['loc'][-1]}" if len(first.get("loc", ())) > 1 else ""
        said = (first.get("ctx") or {}).get("error", first.get("msg"))
        return APIError(400, f"the body is not valid JSON: {said}{where}", code="json_invalid")
    param = _param(first, body) or (first.get("ctx") or {}).get("param")
    if param is None and first.get("type") in ("missing", "model_attributes_type"):
        return APIError(400, _not_an_object(body), code="invalid_value")
    # A validator's own ValueError reads "Value error, <its message>".
    said = str(first.get("msg")).removeprefix("Value error, ")
    message = f"{param}: {said}" if param and not said.startswith(f"{param}=") else said
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return APIError(400, message + more, code="invalid_value", param=param)


def _telling(error: Any) -> tuple[int, bool]:
    """Of the complaints about a union's members, the member that got furthest into the
    value says what is wrong with it (``stop``'s list is too long, not "not a string")."""
    return len(error.get("loc", ())), not str(error.get("type")).endswith("_type")


def _param(error: Any, body: Any) -> str | None:
    """The error's location in the body, without the names pydantic gives a union's
    members (``stop.str``, ``tool_choice.NamedToolChoice``): those are no keys of it."""
    where, value = [], body
    loc = [part for part in error.get("loc", ()) if part != "body"]
    for index, part in enumerate(loc):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif not (error.get("type") == "missing" and index == len(loc) - 1):
            continue
        where.append(str(part))
    return ".".join(where) or None


def _not_an_object(body: Any) -> str:
    if body is None:
        return "the body must be a JSON object; it is empty or null"
    if isinstance(body, bytes):
        return "the body must be a JSON object sent as Content-Type: application/json"
    return f"the body must be a JSON object, not {type(body).__name__}"
