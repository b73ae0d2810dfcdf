"""``kvboost-rag warm FOLDER --server URL``: warm a running ``kvboost-rag serve`` through its
``POST /v1/kvboost/warm``, so the server's own engine (and the tiers it writes) holds the
corpus. Standard library only: the client side needs neither the model nor the server."""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from tqdm.auto import tqdm

from kvboost_rag.cli.arguments import CommandFailed

__all__ = ["warm_through"]

TIMEOUT_S = 3600.0  # a corpus takes long to encode; progress lines keep the socket busy


def warm_through(
    server: str, api_key: str | None, documents: list[str], layout: dict[str, str]
) -> dict[str, Any]:
    """Warm ``documents`` on the server at ``server`` (its root or its ``/v1`` URL) with
    progress on stderr; the summary it answers. ``layout`` is ``{"system": ...}``,
    ``{"prefix": ...}`` or empty. Raises ``CommandFailed`` with one line when the server
    cannot be reached, refuses, or fails the warm."""
    body = {"documents": documents, "stream": True, **layout}
    request = urllib.request.Request(
        _endpoint(server), data=json.dumps(body).encode(), headers=_headers(api_key)
    )
    summary: dict[str, Any] | None = None
    lines = _lines(request, server)
    first = next(lines, None)  # a refusal raises here, before a progress bar is drawn
    with tqdm(unit=" passages", desc="encoding") as bar:
        for line in itertools.chain([first] if first is not None else [], lines):
            if "error" in line:
                raise CommandFailed(f"the server at {server} failed the warm: {_message(line)}")
            if line.get("object") == "kvboost.warm.progress":
                bar.update(line["encoded"] - bar.n)
            elif line.get("object") == "kvboost.warm":
                summary = line
    if summary is None:
        raise CommandFailed(f"the server at {server} ended the warm without its summary")
    return summary


def _endpoint(server: str) -> str:
    root = server.rstrip("/").removesuffix("/v1")
    return f"{root}/v1/kvboost/warm"


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/x-ndjson"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _lines(request: urllib.request.Request, server: str) -> Iterator[dict[str, Any]]:
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            for raw in response:
                if raw.strip():
                    yield json.loads(raw)
    except urllib.error.HTTPError as error:  # before URLError: it is one
        raise CommandFailed(
            f"the server at {server} refused the warm ({error.code}): {_message(_json(error))}"
        ) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise CommandFailed(f"cannot reach a kvboost-rag server at {server}: {reason}") from None


def _json(error: urllib.error.HTTPError) -> dict[str, Any]:
    try:
        body = json.loads(error.read())
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return "no error message"
