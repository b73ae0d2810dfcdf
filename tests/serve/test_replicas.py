"""Two ``kvboost-rag serve`` replicas sharing one Redis Cluster tier: passages one replica
encoded are read, not encoded, by the other (found in unmarked prompts even if it never
warmed them), and one replica killed mid-load leaves the other answering. Real
processes throughout: the cluster's servers and both replicas."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.embedded

MODEL = "smollm2-135m-instruct"
SYSTEM = "Answer from the documents."
# Passages long enough to be reused (over policy.SHORT_PASSAGE tokens each).
DOCS = [
    "The Loire is the longest river in France. It rises in the Massif Central, flows north "
    "and then west for 1,006 kilometres through Orleans, Tours and Nantes, and reaches the "
    "Atlantic at Saint-Nazaire. Its valley holds hundreds of castles, many built in the "
    "sixteenth century, and is listed as a World Heritage Site.",
    "Mont Blanc, at 4,806 metres, is the highest mountain of the Alps. It stands on the "
    "border of France and Italy, above Chamonix and Courmayeur; a road tunnel of 11.6 "
    "kilometres runs beneath it. It was first climbed in 1786 by Jacques Balmat and the "
    "doctor Michel-Gabriel Paccard, which many count as the birth of modern mountaineering.",
]
QUESTION = "\n\n".join(DOCS) + "\n\nHow long is the Loire?"


def warm(server: ServerProcess) -> dict:
    body = {"documents": DOCS, "system": SYSTEM}
    reply = httpx.post(f"{server.url}/kvboost/warm", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def ask(server: ServerProcess) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)


def test_a_corpus_warmed_through_one_replica_is_read_by_the_other(redis_cluster) -> None:
    shared = ("--dtype", "float32", "--remote-url", redis_cluster.url)
    with ServerProcess(MODEL, *shared) as first, ServerProcess(MODEL, *shared) as second:
        encoded = warm(first)
        assert encoded["new"] == encoded["units"] >= len(DOCS) and encoded["failed"] == []
        # The second replica's warm finds every passage in the shared tier: 0 encodes.
        read = warm(second)
        assert read["new"] == 0 and read["cached"] == encoded["units"]
        reply = ask(second)
        reuse = reply.usage.model_extra["kvboost"]
        assert reuse["passages_missed"] == 0 and reuse["passages_hit"] >= len(DOCS)
        assert reply.usage.prompt_tokens_details.cached_tokens > 0
        assert reply.choices[0].message.content == ask(first).choices[0].message.content


def test_a_replica_killed_mid_load_leaves_the_other_answering(redis_cluster) -> None:
    shared = ("--dtype", "float32", "--remote-url", redis_cluster.url)
    with ServerProcess(MODEL, *shared) as doomed, ServerProcess(MODEL, *shared) as survivor:
        warm(doomed)
        warm(survivor)
        answers: list[str | None] = [None] * 4
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                answers[i] = ask(survivor).choices[0].message.content
            except BaseException as error:  # noqa: BLE001 - asserted below
                errors.append(error)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        doomed.kill()
        for thread in threads:
            thread.join()
        assert errors == [] and all(answers)
        assert len(set(answers)) == 1  # greedy: the same prompt, the same answer
        assert ask(survivor).choices[0].message.content == answers[0]


def test_a_replica_finds_passages_warmed_only_through_another(redis_cluster) -> None:
    """The second replica never warmed: it learns of the passages from the shared tier's
    catalogue and finds them in an unmarked prompt."""
    shared = ("--dtype", "float32", "--remote-url", redis_cluster.url)
    with ServerProcess(MODEL, *shared) as first, ServerProcess(MODEL, *shared) as second:
        warm(first)
        assert ask(second).usage.model_extra["kvboost"]["passages_hit"] >= len(DOCS)
