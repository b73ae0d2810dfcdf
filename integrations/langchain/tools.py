"""Tools for ``ChatKVBoost``: LangChain tool definitions and ``tool_choice`` values in the
engine's terms, and a retriever tool whose results are marked passages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from langchain_core.callbacks import Callbacks
from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate, aformat_document, format_document
from langchain_core.retrievers import BaseRetriever
from langchain_core.tools import StructuredTool
from langchain_core.tools.retriever import RetrieverInput
from langchain_core.utils.function_calling import convert_to_openai_tool

from kvboost_rag.integrations._common import documents_as_passages

# LangChain's names for "call some tool" ("any" is LangChain's, "required" OpenAI's).
_REQUIRED = ("any", "required")


def openai_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """BaseTools, pydantic classes, TypedDicts, functions or OpenAI dicts as the OpenAI
    tool dicts the engine takes."""
    if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of tools, got {type(tools).__name__}")
    return [convert_to_openai_tool(tool) for tool in tools]


def tool_choice_name(choice: Any, names: Sequence[str]) -> str:
    """A LangChain ``tool_choice`` as the engine's: "auto" (None, "auto"), "required"
    ("any", "required", True), "none", or the name of one of ``names`` (the name itself
    or ``{"type": "function", "function": {"name": ...}}``)."""
    if choice is None or choice == "auto":
        return "auto"
    if choice is True or choice in _REQUIRED:
        return "required"
    if choice == "none":
        return "none"
    name = _function_name(choice) if isinstance(choice, Mapping) else choice
    if isinstance(name, str) and name in names:
        return name
    raise ValueError(
        f"tool_choice must be None, 'auto', 'any', 'required', True, 'none', a tool's name "
        f"{list(names)} or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"
    )


def _function_name(choice: Mapping[str, Any]) -> Any:
    function = choice.get("function")
    return function.get("name") if isinstance(function, Mapping) else None


def engine_tools(tools: Sequence[Any] | None, choice: Any) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as ``engine.chat`` takes them (the same again when
    given what this returned)."""
    formatted = openai_tools(tools or [])
    names = [str(tool["function"]["name"]) for tool in formatted]
    engine_choice = tool_choice_name(choice, names)
    if not formatted and engine_choice not in ("auto", "none"):
        raise ValueError(f"tool_choice={choice!r} needs tools: pass tools= or use bind_tools")
    return {"tools": formatted, "tool_choice": engine_choice}


def retriever_tool(
    retriever: BaseRetriever,
    name: str,
    description: str,
    *,
    document_prompt: BasePromptTemplate[str] | None = None,
    response_format: Literal["content", "content_and_artifact"] = "content",
) -> StructuredTool:
    """``create_retriever_tool`` whose result marks each document as a passage.

    An agent on ``ChatKVBoost`` then gets the documents in a ``ToolMessage`` the engine
    reads passage by passage: each one's KV is computed once and reused wherever it comes
    back (a later step, another query that retrieves it). ``document_prompt`` formats a
    document before it is marked (default: its ``page_content``); ``response_format=
    "content_and_artifact"`` also returns the documents as the message's artifact.
    """

    def run(query: str, callbacks: Callbacks = None) -> str | tuple[str, list[Document]]:
        docs = retriever.invoke(query, config={"callbacks": callbacks})
        texts = [format_document(d, document_prompt) for d in docs] if document_prompt else None
        return _output(docs, texts, response_format)

    async def arun(query: str, callbacks: Callbacks = None) -> str | tuple[str, list[Document]]:
        docs = await retriever.ainvoke(query, config={"callbacks": callbacks})
        texts = (
            [await aformat_document(d, document_prompt) for d in docs] if document_prompt else None
        )
        return _output(docs, texts, response_format)

    return StructuredTool(
        name=name,
        description=description,
        func=run,
        coroutine=arun,
        args_schema=RetrieverInput,
        response_format=response_format,
    )


def _output(
    docs: list[Document], texts: list[str] | None, response_format: str
) -> str | tuple[str, list[Document]]:
    content = documents_as_passages(docs if texts is None else texts)
    return (content, docs) if response_format == "content_and_artifact" else content
