"""``ChatKVBoost.with_structured_output``: a schema as a forced tool call or a JSON answer
format, and the parser that turns the answer into the schema's object."""

from __future__ import annotations

import json
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import Generation
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

if TYPE_CHECKING:
    from kvboost_rag.integrations.langchain.chat import ChatKVBoost

StructuredMethod = Literal["function_calling", "json_schema", "json_mode"]
METHODS: tuple[str, ...] = ("function_calling", "json_schema", "json_mode")


def structured_output(
    chat: ChatKVBoost,
    schema: dict[str, Any] | type | None,
    method: str,
    include_raw: bool,
    strict: bool | None,
) -> Runnable:
    """``chat`` bound to answer in ``schema``'s form, piped into the matching parser."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if schema is None and method != "json_mode":
        raise ValueError(f"method={method!r} needs a schema; json_mode can go without one")
    trace: dict[str, Any] = {}  # what LangSmith traces show as the requested format
    if schema is not None:
        trace["ls_structured_output_format"] = {"kwargs": {"method": method}, "schema": schema}
    model = schema if isinstance(schema, type) and is_basemodel_subclass(schema) else None
    parser: Runnable
    if method == "function_calling":
        assert schema is not None  # checked above
        name = convert_to_openai_tool(schema)["function"]["name"]
        llm = chat.bind_tools([schema], tool_choice=name, strict=strict, **trace)
        parser = (
            PydanticCallParser(tools=[model], first_tool_only=True)
            if model
            else KeyCallParser(key_name=name, first_tool_only=True)
        )
    else:
        constrain = {} if strict is None else {"constrain": strict}
        llm = chat.bind(response_format=_response_format(schema, method), **constrain, **trace)
        parser = PydanticJsonParser(pydantic_object=model) if model else JsonParser()
    return _with_raw(llm, parser) if include_raw else llm | parser


def _response_format(schema: dict[str, Any] | type | None, method: str) -> dict[str, Any]:
    if method == "json_mode":
        return {"type": "json_object"}
    assert schema is not None  # checked by structured_output
    json_schema = convert_to_json_schema(schema)
    name = str(json_schema.get("title", "answer"))
    return {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema}}


def _with_raw(llm: Runnable, parser: Runnable) -> Runnable:
    """``{"raw": message, "parsed": object or None, "parsing_error": exception or None}``,
    as LangChain's own chat models return it."""
    parsed = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
    )
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")


class _WholeCall:
    """Raises where LangChain's tool parsers return None: the answer's call could not be
    read (cut at max_tokens, or unconstrained output off the schema)."""

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        message = getattr(result[0], "message", None)
        invalid = getattr(message, "invalid_tool_calls", None)
        if invalid and not getattr(message, "tool_calls", None):
            errors = "; ".join(str(call.get("error") or call.get("args")) for call in invalid)
            if getattr(message, "response_metadata", {}).get("finish_reason") == "length":
                why = f"the answer reached max_tokens before its tool call was whole ({errors}); "
                raise OutputParserException(why + "raise max_tokens", llm_output=str(invalid))
            raise OutputParserException(
                f"the model's tool call could not be read ({errors})", llm_output=str(invalid)
            )
        return super().parse_result(result, partial=partial)  # type: ignore[misc]


class _WholeJson:
    """Raises where LangChain's JSON parsers complete a truncated object: an answer cut at
    max_tokens that is not whole JSON."""

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        generation = result[0]
        message = getattr(generation, "message", None)
        cut = getattr(message, "response_metadata", {}).get("finish_reason") == "length"
        if cut and not _is_json(generation.text):
            raise OutputParserException(
                "the JSON answer was cut at max_tokens before it closed; raise max_tokens",
                llm_output=generation.text,
            )
        return super().parse_result(result, partial=partial)  # type: ignore[misc]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class PydanticCallParser(_WholeCall, PydanticToolsParser):
    """The forced call's arguments as the pydantic schema's instance."""


class KeyCallParser(_WholeCall, JsonOutputKeyToolsParser):
    """The forced call's arguments as a dict."""


class PydanticJsonParser(_WholeJson, PydanticOutputParser):  # type: ignore[type-arg]
    """The JSON answer as the pydantic schema's instance."""


class JsonParser(_WholeJson, JsonOutputParser):
    """The JSON answer as a dict."""
