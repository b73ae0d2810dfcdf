"""``GET /metrics`` of a real ``kvboost-rag serve`` process: after requests, its counters and
histograms have moved by what those requests did, in a registry of the app's own."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess

from kvboost_rag import KVBoost
from kvboost_rag.serve import ServeSettings, create_app

pytestmark = pytest.mark.embedded

KEY = "metrics-key-0123"
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Name a colour of the sky."}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(MODEL, "--dtype", "float32", "--api-key", KEY) as process:
        yield process


def scrape(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics by (name, labels)."""
    response = httpx.get(f"{server.root}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_need_the_key(server: ServerProcess) -> None:
    assert httpx.get(f"{server.root}/metrics").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(f"{server.root}/metrics", headers=wrong).status_code == 401


def test_counters_move_by_what_the_requests_did(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    before = scrape(server)
    replies = [
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
        for _ in range(2)
    ]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=8)
    after = scrape(server)
    chat = "/v1/chat/completions"
    assert moved(before, after, "kvboost_requests_total", endpoint=chat, status="200") == 2
    assert moved(before, after, "kvboost_requests_total", endpoint=chat, status="400") == 1
    usage = [reply.usage for reply in replies]
    for kind, counted in (
        ("prompt", sum(u.prompt_tokens for u in usage)),
        ("completion", sum(u.completion_tokens for u in usage)),
        ("cached", sum(u.prompt_tokens_details.cached_tokens for u in usage)),
    ):
        assert moved(before, after, "kvboost_tokens_total", kind=kind) == counted, kind
    assert moved(before, after, "kvboost_tokens_total", kind="cached") > 0  # the second
    for result, field in (("hit", "passages_hit"), ("missed", "passages_missed")):
        counted = sum(u.model_extra["kvboost"][field] for u in usage)
        assert moved(before, after, "kvboost_passages_total", result=result) == counted
    assert moved(before, after, "kvboost_time_to_first_token_seconds_count") == 2
    ttft_s = sum(u.model_extra["kvboost"]["ttft_ms"] for u in usage) / 1e3
    assert moved(before, after, "kvboost_time_to_first_token_seconds_sum") == pytest.approx(
        ttft_s, rel=1e-3, abs=1e-3
    )
    decoding = sum(u.completion_tokens > 1 for u in usage)
    assert moved(before, after, "kvboost_time_per_output_token_seconds_count") == decoding
    assert after[("kvboost_requests_in_flight", ())] == 0
    assert moved(before, after, "kvboost_requests_total", endpoint="/metrics", status="200") == 1


def test_streamed_answers_are_counted_once_they_end(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    before = scrape(server)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    after = scrape(server)
    usage = chunks[-1].usage
    assert moved(before, after, "kvboost_tokens_total", kind="completion") == (
        usage.completion_tokens
    )
    assert moved(before, after, "kvboost_time_to_first_token_seconds_count") == 1


def test_two_apps_in_one_process_count_apart(embedded: KVBoost) -> None:
    """Each app has its own registry: building a second one neither fails on duplicate
    names nor shares the first one's counts."""
    first = create_app(embedded, ServeSettings())
    second = create_app(embedded, ServeSettings())
    assert first is not second
