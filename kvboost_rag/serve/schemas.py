"""The request bodies the server takes, in OpenAI's shapes.

Fields OpenAI defines and the engine has no use for (``user``, ``metadata``, ``store``...)
are ignored, as OpenAI ignores unknown ones; fields that would change the answer and that
the engine cannot honour (``logprobs``, ``logit_bias``, penalties, ``echo``...) are refused
when set, rather than silently dropped. Wrong types and values are refused (the app answers
400): numbers and flags are strict, so ``"0.5"`` is not a temperature and ``1`` not a bool.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvboost_rag.core.generation.sampling import MAX_SEED
from kvboost_rag.core.tools.formats import check_schema

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "NamedToolChoice",
    "ToolSpec",
    "WarmRequest",
]

Real = Annotated[float, Strict()]  # strict floats still take ints, as JSON has no 1.0 apart
Int = Annotated[int, Strict()]


def _shallow(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema``, refused when it nests deeper than the engine walks (``check_schema``)."""
    check_schema(schema, "the schema")
    return schema


Schema = Annotated[dict[str, Any], AfterValidator(_shallow)]

# Set to anything but these harmless values, these fields are refused: the engine cannot do
# what they ask, and answering without it would look like success.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "prediction": (None,),
}


class _Body(BaseModel):
    # "allow" keeps unknown fields in model_extra, where the refused ones are looked for.
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Body:
        for name, value in (self.model_extra or {}).items():
            harmless = UNSUPPORTED.get(name)
            if harmless is not None and not any(value == h for h in harmless):
                # ctx's param names the field: a model's own error has no location.
                raise PydanticCustomError(
                    "unsupported",
                    "{param}={value} is not supported by this server",
                    {"param": name, "value": reprlib.repr(value)},
                )
        return self


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Part):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Part):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI writes it


class ToolCallIn(_Part):
    """A call an assistant message made earlier in the conversation."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Only text parts: the engine's models read text.
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionSpec(_Part):
    name: Annotated[str, Field(strict=True, pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: Schema | None = None
    strict: StrictBool | None = None


class ToolSpec(_Part):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(_Part):
    name: StrictStr


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaSpec(_Part):
    name: StrictStr = "response"
    # "schema" would shadow a BaseModel attribute; the alias keeps OpenAI's name on the wire.
    schema_: Schema = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextFormat(_Part):
    type: Literal["text"]


class JsonObjectFormat(_Part):
    type: Literal["json_object"]


class JsonSchemaFormat(_Part):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class StreamOptions(_Part):
    include_usage: StrictBool | None = None


class _Sampling(_Body):
    """What chat and text completions share."""

    model: StrictStr
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    temperature: Annotated[Real, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Real, Field(gt=0, le=1)] | None = None
    seed: Annotated[Int, Field(ge=0, le=MAX_SEED)] | None = None
    # Answers per prompt; with a seed, answer i samples with seed + i.
    n: Annotated[Int, Field(ge=1, le=16)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # Not OpenAI's: false returns a call that repeats one the messages already answered
    # (the engine's repeat guard withholds it by default). The openai client sends it
    # with extra_body={"repeat_guard": False}.
    repeat_guard: StrictBool | None = None
    response_format: ResponseFormat | None = None

    @field_validator("tool_choice")
    @classmethod
    def _offered(cls, choice: Any, info: ValidationInfo) -> Any:
        """A call asked for is of a tool offered (``tools`` is validated before; a
        ``tools`` refused itself is what the client is told about)."""
        if choice in (None, "auto", "none") or "tools" not in info.data:
            return choice
        names = [tool.function.name for tool in info.data["tools"] or []]
        named = isinstance(choice, NamedToolChoice)
        if named:
            wanted = f"asks for the tool {choice.function.name!r}"
        else:
            wanted = f"{choice!r} asks for a tool call"
        if not names:
            raise ValueError(f"{wanted}, and the request offers no tools")
        if named and choice.function.name not in names:
            raise ValueError(f"{wanted}, which is not among the tools offered, {names}")
        return choice


class CompletionRequest(_Sampling):
    # A string or a list of strings (one answer set each); token-id prompts are refused.
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    max_tokens: Annotated[Int, Field(ge=1)] | None = 16  # OpenAI's default for completions

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class PrefixMessage(_Part):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr


class WarmRequest(_Part):
    """``POST /v1/kvboost/warm``: documents to preload, each one passage, encoded after the
    prompt head they will follow (``prefix``, or ``system`` for chats whose user message
    opens with the passages), as ``warm_corpus`` takes them."""

    documents: Annotated[list[StrictStr], Field(min_length=1)]
    # A completion prompt's text before the passages, or chat messages with a passage()
    # marker where the passages go (``engine.warm_passages(prefix=)``).
    prefix: StrictStr | Annotated[list[PrefixMessage], Field(min_length=1)] | None = None
    system: StrictStr | None = None  # the layout of ``kvboost-rag warm --system``
    batch_size: Annotated[Int, Field(ge=1)] | None = None
    stream: StrictBool = False  # progress as newline-delimited JSON

    @model_validator(mode="after")
    def _one_layout(self) -> WarmRequest:
        if self.prefix is not None and self.system is not None:
            raise ValueError("give prefix or system, not both: they are two prompt layouts")
        return self
