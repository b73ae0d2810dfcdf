"""Tool calling, structured output and the retriever tool in the LangChain adapter: message
translation and option checks without a model, calls and JSON on the embedded SmolLM2."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from conftest import make_model
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, FunctionMessage, HumanMessage, ToolMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from kvboost_rag import KVBoost, KVBoostConfig, format_passages
from kvboost_rag.integrations.langchain import ChatKVBoost, KVBoostPipeline, retriever_tool
from kvboost_rag.integrations.langchain.messages import engine_messages
from kvboost_rag.integrations.langchain.tools import tool_choice_name


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "sunny"


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="first name")
    age: int = Field(description="age in years")


class PersonDict(TypedDict):
    """A person mentioned in the text."""

    name: str
    age: int


PERSON_SCHEMA = Person.model_json_schema()
SCHEMAS = {"pydantic": Person, "typeddict": PersonDict, "dict": PERSON_SCHEMA}
PERSON_PROMPT = "Alice is 30 years old. Reply with JSON with keys name and age."
ADD_PROMPT = "What is 2 plus 3?"
DOCS = [
    Document(page_content="Paris is the capital of France and sits on the Seine."),
    Document(page_content="The Nile flows north through Egypt into the Mediterranean."),
]


class FixedRetriever(BaseRetriever):
    """Returns ``docs`` for any query (the order reversed for queries about rivers)."""

    docs: list[Document]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return self.docs[::-1] if "river" in query else list(self.docs)


@pytest.fixture(scope="module")
def engine(embedded: KVBoost) -> KVBoost:
    """The embedded model with this module's own caches, so reuse counts start at zero."""
    return KVBoost(embedded.model, embedded.tokenizer, KVBoostConfig())


@pytest.fixture(scope="module")
def chat(engine: KVBoost) -> ChatKVBoost:
    return ChatKVBoost(engine=engine, max_tokens=40)


def with_budget(chat: ChatKVBoost, max_tokens: int) -> ChatKVBoost:
    return ChatKVBoost(engine=chat.kv_engine, max_tokens=max_tokens)


def call_signature(message: AIMessage) -> list[tuple[str, dict[str, Any]]]:
    """The calls without their ids (each answer draws new ones)."""
    return [(c["name"], c["args"]) for c in message.tool_calls]


def summed(chunks: list[Any]) -> Any:
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total


# -- without a model -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "engine_choice"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("any", "required"),
        ("required", "required"),
        (True, "required"),
        ("none", "none"),
        ("add", "add"),
        ({"type": "function", "function": {"name": "add"}}, "add"),
    ],
)
def test_tool_choice_in_the_engines_terms(choice: Any, engine_choice: str) -> None:
    assert tool_choice_name(choice, ["add", "get_weather"]) == engine_choice


@pytest.mark.parametrize("choice", ["multiply", False, {"type": "function"}, 3])
def test_a_bad_tool_choice_names_the_valid_ones(choice: Any) -> None:
    with pytest.raises(ValueError, match=r"tool_choice must be .*\['add'\]"):
        tool_choice_name(choice, ["add"])


def test_tool_history_reaches_the_engine_as_calls_and_results() -> None:
    call = {"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1", "type": "tool_call"}
    anthropic_style = [{"type": "text", "text": "Adding."}, {"type": "tool_use", "id": "call_1"}]
    messages = [
        HumanMessage(ADD_PROMPT),
        AIMessage(content=anthropic_style, tool_calls=[call]),
        ToolMessage("5", tool_call_id="call_1", name="add"),
    ]
    _, assistant, result = engine_messages(messages, [])
    assert assistant == {
        "role": "assistant",
        "content": "Adding.",
        "tool_calls": [{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}],
    }
    assert result == {"role": "tool", "content": "5", "tool_call_id": "call_1", "name": "add"}
    with pytest.raises(ValueError, match="'tool_use' content block"):
        engine_messages([AIMessage(content=anthropic_style)], [])  # a call block, no call
    with pytest.raises(ValueError, match="FunctionMessage"):
        engine_messages([FunctionMessage("5", name="add")], [])


def test_retriever_tool_returns_marked_passages() -> None:
    search = retriever_tool(FixedRetriever(docs=DOCS), "search", "Search the notes.")
    assert search.name == "search" and set(search.args) == {"query"}
    assert search.invoke("capital") == format_passages([d.page_content for d in DOCS])
    assert asyncio.run(search.ainvoke("rivers")) == format_passages(
        [d.page_content for d in DOCS[::-1]]
    )
    with_docs = retriever_tool(
        FixedRetriever(docs=DOCS), "search", "Search.", response_format="content_and_artifact"
    )
    call = {"name": "search", "args": {"query": "x"}, "id": "c1", "type": "tool_call"}
    message = with_docs.invoke(call)
    assert isinstance(message, ToolMessage) and message.artifact == DOCS


# -- option checks (they fail before the model runs) ---------------------------------


@pytest.mark.embedded
def test_bad_options_get_specific_errors(chat: ChatKVBoost, engine: KVBoost) -> None:
    with pytest.raises(ValueError, match="tool_choice must be"):
        chat.bind_tools([add], tool_choice="multiply")
    with pytest.raises(ValueError, match="tool_choice must be"):
        chat.invoke(ADD_PROMPT, tools=[add], tool_choice="multiply")
    with pytest.raises(ValueError, match="needs tools"):
        chat.invoke(ADD_PROMPT, tool_choice="any")
    with pytest.raises(TypeError, match="list of tools"):
        chat.bind_tools(add)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unique"):
        chat.bind_tools([add, add], tool_choice="any").invoke(ADD_PROMPT)
    with pytest.raises(TypeError, match="unknown option.*'tools'"):
        chat.invoke(ADD_PROMPT, functions=[add])
    with pytest.raises(ValueError, match="not both"):
        chat.bind_tools([add]).invoke(ADD_PROMPT, response_format={"type": "json_object"})
    llm = KVBoostPipeline(engine=engine, max_tokens=8)
    with pytest.raises(TypeError, match="cannot call tools; use ChatKVBoost"):
        llm.invoke(ADD_PROMPT, tools=[add])
    with pytest.raises(ValueError, match="method must be one of"):
        chat.with_structured_output(Person, method="xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a schema"):
        chat.with_structured_output(None)
    with pytest.raises(ValueError, match="unsupported argument"):
        chat.with_structured_output(Person, tools=[add])


# -- on the embedded model -----------------------------------------------------------


@pytest.mark.embedded
@pytest.mark.parametrize(
    "choice", ["add", "any", {"type": "function", "function": {"name": "add"}}]
)
def test_a_forced_choice_gives_a_valid_call(chat: ChatKVBoost, choice: Any) -> None:
    message = chat.bind_tools([add], tool_choice=choice).invoke(ADD_PROMPT)
    assert message.content == "" and message.invalid_tool_calls == []
    (call,) = message.tool_calls
    assert call["name"] == "add" and call["type"] == "tool_call"
    assert call["id"] and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())
    assert add.invoke(call["args"]) == sum(call["args"].values())  # a runnable call
    assert message.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.embedded
def test_a_named_choice_picks_that_tool_among_several(chat: ChatKVBoost) -> None:
    message = chat.bind_tools([get_weather, add], tool_choice="get_weather").invoke(ADD_PROMPT)
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert isinstance(message.tool_calls[0]["args"]["location"], str)


@pytest.mark.embedded
def test_tool_results_round_trip_and_reuse_the_cached_turns(chat: ChatKVBoost) -> None:
    tools = chat.bind_tools([add], tool_choice="add")
    question = HumanMessage("Please add 17 and 25 for me.")
    first = tools.invoke([question])
    result = add.invoke(first.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.tool_call_id == first.tool_calls[0]["id"]
    answer = chat.bind_tools([add], tool_choice="none", max_tokens=4)
    second = answer.invoke([question, first, result])
    assert second.tool_calls == [] and second.response_metadata["finish_reason"] != "tool_calls"
    cached = second.usage_metadata["input_token_details"]["cache_read"]
    block = chat.kv_engine.config.block_tokens
    # The first request's prompt (tools, question) is read back whole, to the last block.
    assert cached >= first.usage_metadata["input_tokens"] - block


@pytest.mark.embedded
def test_streamed_calls_sum_to_the_invoked_ones(chat: ChatKVBoost) -> None:
    tools = chat.bind_tools([add], tool_choice="any")
    invoked = tools.invoke(ADD_PROMPT)
    chunks = list(tools.stream(ADD_PROMPT))
    assert all(c.tool_call_chunks == [] for c in chunks[:-1])
    assert chunks[-1].chunk_position == "last" and chunks[-1].tool_call_chunks
    total = summed(chunks)
    assert call_signature(total) == call_signature(invoked) != []
    assert total.response_metadata["finish_reason"] == "tool_calls"

    async def astream() -> Any:
        return summed([c async for c in tools.astream(ADD_PROMPT)])

    assert call_signature(asyncio.run(astream())) == call_signature(invoked)


def test_structured_output_cut_at_any_max_tokens_is_reported(tokenizer) -> None:
    """max_tokens=4 returned None silently (the answer '<tool_call' held no call), while
    6-24 raised "raise max_tokens": every budget too small for the call now says so."""
    model = make_model("llama")
    model.config.max_position_embeddings = 2048  # the tools' instructions: ~900 characters
    engine = KVBoost(model, tokenizer)
    for max_tokens in (1, 4, 10, 11, 12, 20):  # the tiny tokenizer spells "<tool_call>" in 11
        chat = ChatKVBoost(engine=engine, max_tokens=max_tokens)
        with pytest.raises(OutputParserException, match="reached max_tokens .* raise max_tokens"):
            chat.with_structured_output(Person).invoke(PERSON_PROMPT)
        out = chat.with_structured_output(Person, include_raw=True).invoke(PERSON_PROMPT)
        assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)
        raw = out["raw"]
        assert raw.tool_calls == [] and len(raw.invalid_tool_calls) == 1
        assert raw.content == "" and raw.response_metadata["finish_reason"] == "length"


@pytest.mark.embedded
def test_a_call_cut_at_max_tokens_stays_invalid_when_streamed(chat: ChatKVBoost) -> None:
    tools = chat.bind_tools([add], tool_choice="add", max_tokens=12)
    invoked = tools.invoke(ADD_PROMPT)
    assert invoked.tool_calls == [] and len(invoked.invalid_tool_calls) == 1
    assert "not valid JSON" in invoked.invalid_tool_calls[0]["error"]
    streamed = summed(list(tools.stream(ADD_PROMPT)))
    # LangChain would complete the cut JSON into a call; the chunk keeps it invalid.
    assert streamed.tool_calls == [] and len(streamed.invalid_tool_calls) == 1
    raw = invoked.invalid_tool_calls[0]["args"]
    assert json.loads(streamed.invalid_tool_calls[0]["args"]) == raw
    for budget in (4, 12):  # 4 stopped inside "<tool_call" and returned None
        with pytest.raises(OutputParserException, match="raise max_tokens"):
            with_budget(chat, budget).with_structured_output(Person).invoke(PERSON_PROMPT)


@pytest.mark.embedded
@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
@pytest.mark.parametrize(
    "schema", [Person, PersonDict, PERSON_SCHEMA], ids=["pydantic", "typeddict", "dict"]
)
def test_structured_output(chat: ChatKVBoost, schema: Any, method: str) -> None:
    answer = chat.with_structured_output(schema, method=method).invoke(PERSON_PROMPT)
    person = answer.model_dump() if schema is Person else answer
    assert isinstance(answer, Person if schema is Person else dict)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert person["name"] == "Alice"


@pytest.mark.embedded
@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_include_raw_returns_message_object_and_error(chat: ChatKVBoost, method: str) -> None:
    out = chat.with_structured_output(Person, method=method, include_raw=True).invoke(PERSON_PROMPT)
    assert isinstance(out["raw"], AIMessage) and out["parsing_error"] is None
    assert isinstance(out["parsed"], Person)
    cut = with_budget(chat, 6).with_structured_output(Person, method=method, include_raw=True)
    out = cut.invoke(PERSON_PROMPT)
    assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)
    assert out["raw"].response_metadata["finish_reason"] == "length"


@pytest.mark.embedded
def test_completion_llm_answers_in_a_json_format(engine: KVBoost) -> None:
    llm = KVBoostPipeline(engine=engine, max_tokens=16)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    form = {"type": "json_schema", "json_schema": {"schema": schema}}
    text = llm.invoke("Is Paris in France? Answer in JSON.", response_format=form)
    assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.embedded
def test_retrieved_passages_in_tool_results_are_reused(chat: ChatKVBoost) -> None:
    search = retriever_tool(FixedRetriever(docs=DOCS), "search", "Search the notes.")
    agent = chat.bind_tools([search], tool_choice="none", max_tokens=4)

    def step(question: str) -> AIMessage:
        call = {"name": "search", "args": {"query": question}, "id": "c1", "type": "tool_call"}
        turn = AIMessage(content="", tool_calls=[call])
        return agent.invoke([HumanMessage(question), turn, search.invoke(call)])

    first = step("What is the capital of France?").response_metadata
    # every note is placed (earlier tests of this module's engine may have cached some)
    assert first["passages_hit"] + first["passages_missed"] >= len(DOCS)
    # Another question, the same passages in another order: each one's KV is read back.
    again = step("Which river flows north?").response_metadata
    assert again["passages_missed"] == 0 and again["passages_hit"] >= len(DOCS)
    assert again["reused_tokens"] > 0
