"""What a new user on Qwen2.5 ran first, through both frameworks on every family users run
(real tokenizers and templates, tiny random weights): LangChain's ``bind_tools`` with a
forced call and ``with_structured_output``, LlamaIndex's ``chat_with_tools`` and
``structured_predict``. On Qwen each raised "token [151657] doesn't satisfy the grammar"
before the grammars took its ``<tool_call>`` token."""

from typing import Annotated

import pytest
from families import family  # noqa: F401 - the fixture
from langchain_core.tools import tool
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from kvboost_rag import KVBoost
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
