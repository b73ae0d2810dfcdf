"""What a new user on Qwen2.5 ran first, through both frameworks on every family users run
(real tokenizers and templates, tiny random weights): LangChain's ``bind_tools`` with a
forced call and ``with_structured_output``, LlamaIndex's ``chat_with_tools`` and
``structured_predict``. On Qwen each raised "token [151657] doesn't satisfy the grammar"
before the grammars took its ``<tool_call>`` token."""

from typing import Annotated

import pytest
from families import family, family_engine  # noqa: F401 - the fixture
from langchain_core.tools import tool
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.tools.template import noted_result
from kvboost_rag.integrations.langchain import ChatKVBoost
from kvboost_rag.integrations.llamaindex import KVBoostLLM


class Cat(BaseModel):
    """A cat mentioned in the text."""

    name: str = Field(description="its name", max_length=8, pattern="^[A-Za-z]+$")
    age: int = Field(description="age in years", ge=0, le=30)


Small = Annotated[int, Field(ge=0, le=99)]  # a random model's numbers end early


def add(a: Small, b: Small) -> int:
    """Add two integers."""
    return a + b


class AddArgs(BaseModel):
    """LlamaIndex drops ``Annotated`` bounds from a function's schema; it keeps these."""

    a: Small
    b: Small


PROMPT = "Tom is a cat, 3 years old. What is 2 plus 3?"


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(family: KVBoost, method: str) -> None:  # noqa: F811
    chat = ChatKVBoost(engine=family, max_tokens=64)
    cat = chat.with_structured_output(Cat, method=method).invoke(PROMPT)
    assert isinstance(cat, Cat)


def test_langchain_forced_tool_call(family: KVBoost) -> None:  # noqa: F811
    chat = ChatKVBoost(engine=family, max_tokens=64)
    message = chat.bind_tools([tool(add)], tool_choice="any").invoke(PROMPT)
    (call,) = message.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert message.invalid_tool_calls == []


def test_llamaindex_tool_selection_and_structured_predict(family: KVBoost) -> None:  # noqa: F811
    llm = KVBoostLLM(engine=family, max_tokens=64)
    response = llm.chat_with_tools(
        [FunctionTool.from_defaults(add, fn_schema=AddArgs)], PROMPT, tool_required=True
    )
    (selection,) = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "add" and set(selection.tool_kwargs) == {"a", "b"}
    cat = llm.structured_predict(Cat, PromptTemplate("{text} Give the cat."), text=PROMPT)
    assert isinstance(cat, Cat)


def qwen_step_two(tokenizer, tools: list[dict], noted: bool = True) -> list[int]:  # type: ignore[no-untyped-def]
    """An agent's second step in Qwen's own message format (a call's arguments as a dict,
    the result as a ``tool`` message), through Qwen's template; ``noted``: the result as
    the engine writes it by default, a sentence in a user turn's ``<tool_response>`` tags
    followed by what to do next (``KVBoostConfig.tool_result_notes``)."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    text = noted_result('add({"a": 2, "b": 3})', "5")
    result = {"role": "user", "content": text} if noted else {"role": "tool", "content": "5"}
    messages = [
        {"role": "system", "content": "Use a tool."},
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        result,
    ]
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_dict=False
    )
    return list(ids)


def test_langchain_agent_step_renders_as_qwens_template() -> None:
    """The call re-rendered in ``<tool_call>`` tags and the result in ``<tool_response>``
    tags of a user turn, with the tools listed again, as Qwen's template writes them (the
    note after the result aside, and without it where ``tool_result_notes=False``)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    from kvboost_rag.integrations.langchain.messages import engine_messages
    from kvboost_rag.integrations.langchain.tools import openai_tools

    engine = family_engine("qwen2.5")
    tools = openai_tools([tool(add)])
    history = [
        SystemMessage("Use a tool."),
        HumanMessage(PROMPT),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}]),
        ToolMessage("5", tool_call_id="call_1", name="add"),
    ]
    ids = engine.tokenize_chat(engine_messages(history, []), tools=tools)
    assert ids == qwen_step_two(engine.tokenizer, tools)
    plain = KVBoost(engine.model, engine.tokenizer, KVBoostConfig(tool_result_notes=False))
    ids = plain.tokenize_chat(engine_messages(history, []), tools=tools)
    assert ids == qwen_step_two(engine.tokenizer, tools, noted=False)


def test_llamaindex_agent_step_renders_as_qwens_template() -> None:
    from llama_index.core.base.llms.types import ChatMessage, TextBlock, ToolCallBlock

    from kvboost_rag.integrations.llamaindex.function_calling import tool_specs
    from kvboost_rag.integrations.llamaindex.messages import engine_messages

    engine = family_engine("qwen2.5")
    tools = tool_specs([FunctionTool.from_defaults(add, fn_schema=AddArgs)])
    call = ToolCallBlock(tool_call_id="call_1", tool_name="add", tool_kwargs={"a": 2, "b": 3})
    history = [
        ChatMessage(role="system", content="Use a tool."),
        ChatMessage(role="user", content=PROMPT),
        ChatMessage(role="assistant", blocks=[TextBlock(text=""), call]),
        ChatMessage(
            role="tool", content="5", additional_kwargs={"tool_call_id": "call_1", "name": "add"}
        ),
    ]
    ids = engine.tokenize_chat(engine_messages(history), tools=tools)
    assert ids == qwen_step_two(engine.tokenizer, tools)
