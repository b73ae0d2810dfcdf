"""What the server does with requests in flight: a client that leaves cancels its request,
a full queue answers 429, a request past its time limit is cancelled and answered 504.
The server runs on a thread of the test process (``serving``), so the tests can see the
engine's streams behind their HTTP requests."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from kvboost_rag import KVBoost
from kvboost_rag.core.generation.streaming import GenerationStream
from kvboost_rag.serve import ServeSettings, serving

pytestmark = pytest.mark.embedded

MODEL = "smollm2-135m-instruct"
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
    "max_tokens": 400,  # tens of seconds on a CPU: still running when the test acts
}


class Recording:
    """The engine, keeping every stream the app opens."""

    def __init__(self, engine: KVBoost) -> None:
        self.engine = engine
        self.streams: list[GenerationStream] = []

    def stream_chat(self, *args: Any, **kwargs: Any) -> GenerationStream:
        stream = self.engine.stream_chat(*args, **kwargs)
        self.streams.append(stream)
        return stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _until(condition: Any, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _cancelled(stream: GenerationStream) -> bool:
    return stream.result is not None and stream.result.finish_reason == "cancelled"


def _in_flight(url: str) -> int:
    return int(httpx.get(url.removesuffix("/v1") + "/health").json()["in_flight"])


def test_a_client_leaving_mid_stream_cancels_its_request(embedded: KVBoost) -> None:
    engine = Recording(embedded)
    with serving(engine, ServeSettings(model_name=MODEL, port=0)) as url:  # type: ignore[arg-type]
        with httpx.stream("POST", f"{url}/chat/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            data = [line for line in (next(lines) for _ in range(8)) if line.startswith("data:")]
            assert len(data) >= 3  # the stream had started
        (stream,) = engine.streams
        assert _until(lambda: _cancelled(stream)), stream.result
        assert stream.result.completion_tokens < 400
        assert _until(lambda: _in_flight(url) == 0)


def test_a_full_queue_answers_429_with_retry_after(embedded: KVBoost) -> None:
    settings = ServeSettings(model_name=MODEL, port=0, max_queue=1, retry_after_s=3)
    with serving(embedded, settings) as url:
        with httpx.stream("POST", f"{url}/chat/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            refused = httpx.post(f"{url}/chat/completions", json={**LONG, "max_tokens": 2})
            assert refused.status_code == 429
            assert refused.headers["Retry-After"] == "3"
            assert refused.json()["error"]["type"] == "rate_limit_error"
        assert _until(lambda: _in_flight(url) == 0)
        again = httpx.post(f"{url}/chat/completions", json={**LONG, "max_tokens": 2}, timeout=60)
        assert again.status_code == 200


def test_more_answers_than_the_server_takes_are_refused_before_any_opens(
    embedded: KVBoost,
) -> None:
    """A prompt list of 1,000 with ``n: 16`` opened 16,000 streams as one request."""
    engine = Recording(embedded)
    settings = ServeSettings(model_name=MODEL, port=0, max_answers=4)
    with serving(engine, settings) as url:  # type: ignore[arg-type]
        body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1, "n": 2}
        refused = httpx.post(f"{url}/completions", json=body, timeout=60)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "n" and "6 answers (3 prompt(s) x n=2)" in error["message"]
        assert "at most 4" in error["message"] and engine.streams == []
        fits = httpx.post(f"{url}/completions", json={**body, "n": 1}, timeout=60)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 3
        assert _until(lambda: _in_flight(url) == 0)


def test_a_request_past_its_time_limit_is_cancelled_and_answered_504(embedded: KVBoost) -> None:
    engine = Recording(embedded)
    settings = ServeSettings(model_name=MODEL, port=0, request_timeout_s=1.0)
    with serving(engine, settings) as url:  # type: ignore[arg-type]
        start = time.monotonic()
        whole = httpx.post(f"{url}/chat/completions", json=LONG, timeout=60)
        assert whole.status_code == 504 and time.monotonic() - start < 10
        assert whole.json()["error"]["code"] == "timeout"
        streamed = httpx.post(f"{url}/chat/completions", json={**LONG, "stream": True}, timeout=60)
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-1])["error"]["code"] == "timeout"  # no [DONE] after it
        assert len(engine.streams) == 2
        assert _until(lambda: all(_cancelled(s) for s in engine.streams))
        assert _until(lambda: _in_flight(url) == 0)
