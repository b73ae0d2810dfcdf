"""The LlamaIndex adapter as a function-calling LLM: tool calls, tool results, structured
outputs and agents on the embedded SmolLM2 (fp32). The model's answers are not judged, only
what the adapter guarantees: calls are valid, results reach the next step, KV is reused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

pytest.importorskip("llama_index.core")

import torch  # noqa: E402
from llama_index.core.agent.workflow import (  # noqa: E402
    AgentInput,
    AgentWorkflow,
    FunctionAgent,
    ReActAgent,
    ToolCallResult,
)
from llama_index.core.base.base_retriever import BaseRetriever  # noqa: E402
from llama_index.core.base.llms.types import (  # noqa: E402
    ChatMessage,
    ChatResponse,
    ImageBlock,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.program import FunctionCallingProgram  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from kvboost_rag import KVBoost  # noqa: E402
from kvboost_rag.core.prompt.chunker import parse_segments  # noqa: E402
from kvboost_rag.integrations.llamaindex import KVBoostLLM, retriever_tool  # noqa: E402
from kvboost_rag.integrations.llamaindex.messages import engine_messages  # noqa: E402

pytestmark = pytest.mark.embedded

QUESTION = "What is 2 plus 3?"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOLS = [FunctionTool.from_defaults(add), FunctionTool.from_defaults(multiply)]


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


class Trip(BaseModel):
    """A trip: where it starts and how many days it lasts."""

    start: City
    days: int


class FixedRetriever(BaseRetriever):
    """Returns the same nodes for any query (retrieval itself is not under test)."""

    def __init__(self, texts: Sequence[str]) -> None:
        super().__init__()
        self.texts = list(texts)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=t), score=1.0) for t in self.texts]


@pytest.fixture(scope="module")
def llm() -> KVBoostLLM:
    engine = KVBoost.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    return KVBoostLLM(engine=engine, max_tokens=48)


def check_call(selection: object, tools: Sequence[FunctionTool] = TOOLS) -> FunctionTool:
    """The selected tool, after checking its arguments against the tool's schema."""
    by_name = {t.metadata.name: t for t in tools}
    tool = by_name[selection.tool_name]  # type: ignore[attr-defined]
    tool.metadata.fn_schema.model_validate(selection.tool_kwargs)  # type: ignore[attr-defined,union-attr]
    assert selection.tool_id  # type: ignore[attr-defined]
    return tool


# -- chat with tools -------------------------------------------------------------------


def test_metadata_says_function_calling_only_with_a_chat_template(llm: KVBoostLLM) -> None:
    assert llm.metadata.is_function_calling_model
    plain = KVBoostLLM(engine=llm.engine, is_chat_model=False)
    assert not plain.metadata.is_function_calling_model
    with pytest.raises(ValueError, match="is_chat_model=False"):
        plain.chat_with_tools(TOOLS, user_msg=QUESTION)


def test_chat_with_tools_required_gives_a_valid_tool_selection(llm: KVBoostLLM) -> None:
    response = llm.chat_with_tools(TOOLS, user_msg=QUESTION, tool_required=True)
    (selection,) = llm.get_tool_calls_from_response(response)
    check_call(selection)
    assert response.message.content == ""  # required: the answer is the call alone
    (mirrored,) = response.message.additional_kwargs["tool_calls"]  # where older code looks
    assert mirrored["id"] == selection.tool_id
    assert mirrored["function"]["name"] == selection.tool_name
    assert json.loads(mirrored["function"]["arguments"]) == selection.tool_kwargs
    assert response.additional_kwargs["finish_reason"] != "length"


def test_a_tool_result_round_trip_reuses_the_cache(llm: KVBoostLLM) -> None:
    first = llm.chat_with_tools(TOOLS, user_msg=QUESTION, tool_choice="add")
    (call,) = llm.get_tool_calls_from_response(first)
    output = check_call(call).call(**call.tool_kwargs)
    result = ChatMessage(
        role="tool", blocks=output.blocks, additional_kwargs={"tool_call_id": call.tool_id}
    )
    history = [ChatMessage(role="user", content=QUESTION), first.message, result]
    sent = engine_messages(history)
    assert sent[1]["tool_calls"] == [
        {"id": call.tool_id, "name": "add", "arguments": call.tool_kwargs}
    ]
    assert sent[2] == {"role": "tool", "content": output.content, "tool_call_id": call.tool_id}
    second = llm.chat_with_tools(TOOLS, chat_history=history, max_tokens=4)
    # The call is rendered back as the model wrote it, so the whole first prompt and the
    # call itself are read from the cache.
    assert second.additional_kwargs["reused_tokens"] > first.additional_kwargs["prompt_tokens"]


async def test_streaming_gives_the_same_calls_in_the_last_chunk(llm: KVBoostLLM) -> None:
    answer = llm.chat_with_tools(TOOLS, user_msg=QUESTION, tool_choice="multiply")
    chunks = list(llm.stream_chat_with_tools(TOOLS, user_msg=QUESTION, tool_choice="multiply"))
    achunks = [
        c
        async for c in await llm.astream_chat_with_tools(
            TOOLS, user_msg=QUESTION, tool_choice="multiply"
        )
    ]
    expected = [(s.tool_name, s.tool_kwargs) for s in llm.get_tool_calls_from_response(answer)]
    assert expected and expected[0][0] == "multiply"
    for stream in (chunks, achunks):
        calls = [llm.get_tool_calls_from_response(c, error_on_no_tool_call=False) for c in stream]
        assert not any(calls[:-1])  # the call is held back until it is whole
        assert [(s.tool_name, s.tool_kwargs) for s in calls[-1]] == expected
        assert "".join(c.delta or "" for c in stream) == answer.message.content
        assert stream[-1].additional_kwargs["completion_tokens"] > 0


def test_only_one_call_unless_parallel_calls_are_allowed(llm: KVBoostLLM) -> None:
    calls = [ToolCallBlock(tool_name="add", tool_kwargs={"a": i, "b": 1}) for i in range(2)]
    message = ChatMessage(
        role="assistant",
        blocks=[TextBlock(text=""), *calls],
        additional_kwargs={"tool_calls": ["first", "second"]},
    )
    both = llm._validate_chat_with_tools_response(ChatResponse(message=message), TOOLS, True)
    assert len(llm.get_tool_calls_from_response(both)) == 2
    one = llm._validate_chat_with_tools_response(ChatResponse(message=message), TOOLS, False)
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(one)] == [{"a": 0, "b": 1}]
    assert one.message.additional_kwargs["tool_calls"] == ["first"]


# -- structured outputs ----------------------------------------------------------------


async def test_structured_predict_returns_the_pydantic_object(llm: KVBoostLLM) -> None:
    prompt = PromptTemplate("{city} is the capital of {country}. Give the city.")
    city = llm.structured_predict(City, prompt, city="Paris", country="France")
    assert isinstance(city, City) and city.name and city.country
    trip = await llm.astructured_predict(
        Trip, PromptTemplate("Plan a {days} day trip from Rome, Italy."), days="3"
    )
    assert isinstance(trip, Trip) and isinstance(
        trip.start, City
    )  # nested: $defs resolve in the call schema
    answer = llm.as_structured_llm(City).chat([ChatMessage(role="user", content="Tokyo, Japan")])
    assert isinstance(answer.raw, City)
    assert City.model_validate_json(answer.message.content or "") == answer.raw
    # Streamed, LlamaIndex asks for the tool only when the program names it (it does not
    # pass tool_required), and reads the call from additional_kwargs["tool_calls"].
    program = FunctionCallingProgram.from_defaults(
        output_cls=City, llm=llm, prompt=prompt, tool_choice="City"
    )
    *_, streamed = program.stream_call(city="Paris", country="France")
    assert streamed == city


def test_response_format_answers_json_in_the_schema(llm: KVBoostLLM) -> None:
    schema = {"type": "json_schema", "json_schema": {"schema": City.model_json_schema()}}
    question = [ChatMessage(role="user", content="Paris is in France. Give the city.")]
    City.model_validate_json(llm.chat(question, response_format=schema).message.content or "")
    City.model_validate_json(llm.complete("Rome, Italy as JSON:", response_format=schema).text)


# -- agents ----------------------------------------------------------------------------


async def run_agent(workflow: AgentWorkflow | FunctionAgent | ReActAgent) -> tuple[list, list]:
    """The LLM inputs and tool results of a run, which must finish with an answer."""
    handler = workflow.run(QUESTION, max_iterations=3)
    inputs, results = [], []
    async for event in handler.stream_events():
        if isinstance(event, AgentInput):
            inputs.append(event.input)
        if isinstance(event, ToolCallResult):
            results.append(event)
    output = await handler
    assert isinstance(output.response.content, str)
    return inputs, results


@pytest.mark.parametrize("wrapped", [False, True], ids=["FunctionAgent", "AgentWorkflow"])
async def test_function_agent_calls_a_tool_and_uses_its_output(
    llm: KVBoostLLM, wrapped: bool
) -> None:
    # initial_tool_choice forces the first step's call (the grammar makes it valid). Allowed
    # several calls per answer, the 135M model repeats its call, so one per answer; and
    # "generate" ends the run with a tool-free answer should it never stop calling.
    own = KVBoostLLM(engine=llm.engine, max_tokens=48)
    agent = FunctionAgent(
        tools=TOOLS,
        llm=own,
        initial_tool_choice="add",
        allow_parallel_tool_calls=False,
        early_stopping_method="generate",
        streaming=wrapped,
    )
    inputs, results = await run_agent(AgentWorkflow(agents=[agent]) if wrapped else agent)
    first = results[0]
    assert first.tool_name == "add" and not first.tool_output.is_error
    check_call(first)
    assert first.tool_output.raw_output == add(**first.tool_kwargs)
    tool_messages = [m for m in inputs[1] if m.role == "tool"]
    assert tool_messages[0].content == str(first.tool_output.raw_output)
    assert tool_messages[0].additional_kwargs["tool_call_id"] == first.tool_id
    assert own.last_stats and own.last_stats["reused_tokens"] > 0


def test_agent_workflow_from_tools_runs_them_with_a_function_agent(llm: KVBoostLLM) -> None:
    workflow = AgentWorkflow.from_tools_or_functions([add, multiply], llm=llm)
    assert all(isinstance(agent, FunctionAgent) for agent in workflow.agents.values())


async def test_react_agent_still_runs(llm: KVBoostLLM) -> None:
    own = KVBoostLLM(engine=llm.engine, max_tokens=48)
    inputs, _ = await run_agent(ReActAgent(tools=TOOLS, llm=own, early_stopping_method="generate"))
    assert inputs and own.last_stats and own.last_stats["completion_tokens"] > 0


# -- retriever tool ----------------------------------------------------------------------

PASSAGES = [
    "Lake Baikal in Siberia is the deepest lake on Earth, about 1642 metres deep.",
    "The Dead Sea lies about 430 metres below sea level, the lowest land on Earth.",
]


def test_retriever_tool_output_is_the_nodes_as_marked_passages() -> None:
    tool = retriever_tool(FixedRetriever(PASSAGES), name="lookup", description="Find facts.")
    output = tool.call(query="deepest lake")
    assert [s.text for s in parse_segments(output.content) if s.kind == "passage"] == PASSAGES
    assert [n.node.get_content() for n in output.raw_output] == PASSAGES
    assert tool("deepest lake").content == output.content  # one-argument tools: by position
    assert asyncio.run(tool.acall(query="x")).content == output.content
    spec = tool.metadata.to_openai_tool()["function"]
    assert spec["name"] == "lookup" and spec["parameters"]["required"] == ["query"]
    with pytest.raises(ValueError, match="one string"):
        tool.call(query="a", k=2)


def test_retrieved_passages_in_tool_results_reuse_their_kv(llm: KVBoostLLM) -> None:
    tool = retriever_tool(FixedRetriever(PASSAGES))
    output = tool.call(query="lakes")
    stats = []
    for question in ("How deep is Lake Baikal?", "Where is the Dead Sea?"):
        call = ToolCallBlock(
            tool_call_id="call_1", tool_name="retrieve", tool_kwargs={"query": "lakes"}
        )
        history = [
            ChatMessage(role="user", content=question),
            ChatMessage(role="assistant", blocks=[TextBlock(text=""), call]),
            ChatMessage(
                role="tool", content=output.content, additional_kwargs={"tool_call_id": "call_1"}
            ),
        ]
        stats.append(
            llm.chat_with_tools([tool], chat_history=history, max_tokens=2).additional_kwargs
        )
    # every note is placed (earlier tests of this module's engine may have cached some,
    # and text they share with these prompts is found too), then read back
    assert stats[0]["passages_missed"] + stats[0]["passages_hit"] >= 2
    assert stats[1]["passages_missed"] == 0 and stats[1]["passages_hit"] >= 2


# -- errors ----------------------------------------------------------------------------


def test_malformed_input_fails_clearly(llm: KVBoostLLM) -> None:
    image = ChatMessage(role="user", blocks=[ImageBlock(url="http://example.invalid/a.png")])
    with pytest.raises(ValueError, match=r"messages\[0\] \(user\) has a ImageBlock"):
        llm.chat([image])
    broken = ToolCallBlock(tool_name="add", tool_kwargs="{not json")
    with pytest.raises(ValueError, match="not a JSON object"):
        engine_messages([ChatMessage(role="assistant", blocks=[broken])])
    with pytest.raises(ValueError, match="tool_choice must be"):
        llm.chat_with_tools(TOOLS, user_msg=QUESTION, tool_choice="divide")
    with pytest.raises(ValueError, match="contradicts"):
        llm.chat_with_tools(TOOLS, user_msg=QUESTION, tool_choice="none", tool_required=True)
    with pytest.raises(TypeError, match=r"tools\[0\] is a object"):
        llm.chat([ChatMessage(role="user", content=QUESTION)], tools=[object()])
    with pytest.raises(TypeError, match="unknown option"):
        llm.chat_with_tools(TOOLS, user_msg=QUESTION, max_new_tokens=3)
    text = ChatResponse(message=ChatMessage(role="assistant", content="5"))
    assert llm.get_tool_calls_from_response(text, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="without a tool call: '5'.*tool_required=True"):
        llm.get_tool_calls_from_response(text)
