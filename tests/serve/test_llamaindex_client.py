"""LlamaIndex's ``OpenAILike`` against a real ``kvboost-rag serve`` process: a query engine
over a vector index answers as the in-process engine does for the very messages LlamaIndex
sent, a ``FunctionAgent`` calls its tool and answers from its output, and streamed chats
are the whole answer."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_process import ServerProcess

from kvboost_rag import KVBoost

pytestmark = pytest.mark.embedded
openai_like = pytest.importorskip("llama_index.llms.openai_like")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.agent.workflow import (  # noqa: E402
    AgentOutput,
    FunctionAgent,
    ToolCallResult,
)
from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402

KEY = "llamaindex-key-0123"
MODEL = "smollm2-135m-instruct"
DOCS = [
    "The Loire is the longest river in France, flowing 1,006 kilometres to the Atlantic.",
    "Mont Blanc, at 4,806 metres, is the highest mountain of the Alps.",
    "Lyon sits where the Rhone and the Saone rivers meet.",
]


class BagOfWords(BaseEmbedding):
    """A hashed bag of words: a query lands nearest the document that shares its words."""

    dim: int = 64

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * self.dim
        for word in re.findall(r"\w+", text.lower()):
            digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
            vector[int.from_bytes(digest, "little") % self.dim] += 1.0
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        return [x / norm for x in vector]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)


class Wire:
    """The JSON bodies an LLM's HTTP clients posted, in order: what LlamaIndex really sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def record(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content))

    async def arecord(self, request: httpx.Request) -> None:
        self.record(request)

    def clients(self) -> dict[str, Any]:
        return {
            "http_client": httpx.Client(event_hooks={"request": [self.record]}),
            "async_http_client": httpx.AsyncClient(event_hooks={"request": [self.arecord]}),
        }


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(MODEL, "--dtype", "float32", "--api-key", KEY) as process:
        yield process


@pytest.fixture
def wire() -> Wire:
    return Wire()


def client(server: ServerProcess, wire: Wire, **fields: Any) -> Any:
    """An ``OpenAILike`` chat model on the server; temperature 0 for the greedy answers (its
    default is 0.1)."""
    return openai_like.OpenAILike(
        api_base=server.url,
        api_key=KEY,
        model=MODEL,
        is_chat_model=True,
        temperature=0.0,
        max_tokens=fields.pop("max_tokens", 24),
        timeout=120,
        max_retries=0,
        **wire.clients(),
        **fields,
    )


def test_a_query_engine_answers_as_the_engine_does(
    server: ServerProcess, wire: Wire, embedded: KVBoost
) -> None:
    index = VectorStoreIndex.from_documents(
        [Document(text=text) for text in DOCS], embed_model=BagOfWords()
    )
    engine = index.as_query_engine(llm=client(server, wire), similarity_top_k=1)
    response = engine.query("Which river is the longest in France?")
    assert [n.node.get_content() for n in response.source_nodes] == [DOCS[0]]
    [body] = wire.bodies  # one chat completion, with LlamaIndex's own prompt
    assert DOCS[0] in body["messages"][-1]["content"]
    here = embedded.chat(body["messages"], max_new_tokens=body["max_tokens"])
    assert str(response) == here.text and here.text


def test_stream_chat_and_stream_complete_are_the_whole_answer(
    server: ServerProcess, wire: Wire, embedded: KVBoost
) -> None:
    llm = client(server, wire)
    question = "Name three colours of the rainbow."
    whole = llm.chat([ChatMessage(role="user", content=question)]).message.content
    chunks = list(llm.stream_chat([ChatMessage(role="user", content=question)]))
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].message.content == whole
    assert sum(1 for c in chunks if c.delta) >= 8  # token by token, not one chunk at the end
    assert "".join(c.delta or "" for c in llm.stream_complete(question)) == whole
    here = embedded.chat([{"role": "user", "content": question}], max_new_tokens=24)
    assert whole == here.text and here.text


async def test_a_function_agent_calls_its_tool_and_answers_as_the_engine_does(
    server: ServerProcess, wire: Wire, embedded: KVBoost
) -> None:
    """SmolLM2-135M answers this question in prose when ``tool_choice`` is "auto" (tried:
    no call), so the agent names the tool for its first turn only (``initial_tool_choice``,
    sent as OpenAI's named ``tool_choice``); its second turn is free and answers. The agent
    streams (its default): the call reaches it as a streamed tool-call delta."""
    calls: list[str] = []

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(get_weather)],
        llm=client(server, wire, max_tokens=40, is_function_calling_model=True),
        system_prompt="You can look up the weather.",
        initial_tool_choice="get_weather",
        timeout=300,
    )
    result: AgentOutput = await agent.run("What is the weather in Paris?", max_iterations=4)
    assert len(calls) == 1 and "Paris" in calls[0]
    [done] = result.tool_calls
    assert isinstance(done, ToolCallResult)  # what the agent ran, with its output
    assert done.tool_name == "get_weather" and done.tool_kwargs == {"city": calls[0]}
    assert not done.tool_output.is_error
    first, last = wire.bodies  # the forced call, then the answer
    assert first["stream"] and last["stream"]
    assert first["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert last["tool_choice"] == "auto"
    assert last["messages"][-1]["role"] == "tool"
    assert last["messages"][-1]["content"] == f"It is sunny in {calls[0]}."
    here = embedded.chat(
        last["messages"],
        tools=last["tools"],
        parallel_tool_calls=last["parallel_tool_calls"],
        max_new_tokens=last["max_tokens"],
    )
    assert result.response.content == here.text and here.text and not here.tool_calls
