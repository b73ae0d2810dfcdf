"""From what users pass (text, messages, passages) to the model's tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

from kvboost_rag.core.errors import ContextWindowError, EmptyPromptError, KVBoostError
from kvboost_rag.core.prompt.chunker import (
    Segment,
    TokenizedPrompt,
    format_passages,
    parse_segments,
    passage,
    passage_ids,
    passage_texts,
    tokenize_segments,
)
from kvboost_rag.core.tools.formats import Tool, ToolFormat, format_for
from kvboost_rag.core.tools.template import render_chat
from kvboost_rag.core.tools.written import WrittenCalls

# What stands for the passages after a prefix given as text: a word, as passages begin.
_PLACEHOLDER = "Text"

# {"role", "content"}; assistant messages may carry "tool_calls", tool results
# "tool_call_id" / "name" (see core/tools/template.py).
Message = dict[str, Any]


class ChatTemplateError(KVBoostError, ValueError):
    """The tokenizer's chat template refused the messages (a role it does not know, turns
    that do not alternate, ...): its own words, raised from inside transformers' jinja."""


class PromptEncoder:
    def __init__(
        self,
        tokenizer: Any,
        context_window: int,
        max_passage_tokens: int,
        tool_result_notes: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.tool_result_notes = tool_result_notes
        self.written = WrittenCalls()  # calls the engine returned, rendered as the model wrote them
        self.context_window = context_window
        self.max_passage_tokens = max_passage_tokens
        self.special_prefix = _special_prefix(tokenizer)  # e.g. [BOS] where the tokenizer adds it

    def text(self, prompt: str, passages: Sequence[str] | None = None) -> TokenizedPrompt:
        """A completion prompt; ``passages`` are placed before it, each marked as a passage."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        texts = _passage_list(passages)
        if not prompt and not texts:
            raise EmptyPromptError("prompt is empty: pass the text to complete")
        return self._checked(format_passages(texts) + prompt, self.special_prefix)

    def passages(self, texts: Sequence[str] | str) -> list[list[int]]:
        """Token ids of each passage (piece) to warm: each text of a list is one passage
        (layout around it does not matter), a string is a prompt whose marked passages
        are taken."""
        marked = texts if isinstance(texts, str) else format_passages(_passage_list(texts))
        segments = [s for s in _parse(marked) if s.kind == "passage"]
        own = passage_texts(segments, self.tokenizer, self.max_passage_tokens)
        pieces = [ids for ids in passage_ids(own, self.tokenizer) if ids]
        for piece in pieces:
            if len(piece) >= self.context_window:
                raise ContextWindowError(len(piece), self.context_window, what="a passage")
        return pieces

    def prefix(self, spec: str | Sequence[Message]) -> list[int]:
        """The tokens before the first passage of ``spec``: a completion prompt (when it
        marks no passage, the passages follow all of it) or chat messages that mark where
        passages go. Tokenized as the prompt will be, with a passage after it: a tokenizer
        may spell the text's end otherwise when more follows (SmolLM2 splits a blank line
        before a word into two newline tokens)."""
        if isinstance(spec, str):
            segments = _parse(spec)
            if not any(s.kind == "passage" for s in segments):
                segments = _parse(spec + passage(_PLACEHOLDER))
            prompt = tokenize_segments(
                segments, self.tokenizer, self.special_prefix, self.max_passage_tokens
            )
        elif isinstance(spec, (list, tuple)):
            prompt = self.chat(spec)
            if not prompt.passages:
                raise ValueError(
                    "prefix messages mark no passage: put passage(text) where the passages go"
                )
        else:
            raise TypeError(f"prefix must be a str or chat messages, got {type(spec).__name__}")
        return before_passages(prompt)

    def chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] = (),
        fmt: ToolFormat | None = None,
    ) -> TokenizedPrompt:
        """Messages (and tools) through the tokenizer's chat template (markers survive it)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, (Sequence, type(None))):
            raise TypeError(
                f"messages must be a list of {{'role', 'content'}} dicts, got "
                f"{type(messages).__name__}"
            )
        if not messages:
            raise EmptyPromptError("messages is empty: pass at least one {'role', 'content'} dict")
        for i, message in enumerate(messages):
            _check_message(message, i)
        if not any(_said(message) for message in messages):
            raise EmptyPromptError(
                "every message's content is empty or only whitespace: pass the text to answer"
            )
        try:
            text = render_chat(
                self.tokenizer,
                messages,
                tools,
                fmt or self.tool_format(),
                self.tool_result_notes,
                self.written,
            )
        except TemplateError as error:
            raise ChatTemplateError(
                f"the tokenizer's chat template refused these messages: {error}"
            ) from error
        # The template already holds the special tokens; adding them again would double BOS.
        return self._checked(text, [])

    def tool_format(self, override: str = "auto") -> ToolFormat:
        """The tool-call format of this tokenizer's chat template (or ``override``)."""
        return format_for(getattr(self.tokenizer, "chat_template", None), override)

    def _checked(self, text: str, prefix: list[int]) -> TokenizedPrompt:
        segments = _parse(text)
        if all(not s.text.strip() for s in segments):  # a model asked to continue nothing
            what = "empty" if not text else "only whitespace"
            raise EmptyPromptError(f"prompt is {what}: pass the text to complete")
        prompt = tokenize_segments(segments, self.tokenizer, prefix, self.max_passage_tokens)
        if not prompt.tokens:
            raise EmptyPromptError("prompt has no tokens after tokenization")
        if len(prompt.tokens) >= self.context_window:
            raise ContextWindowError(len(prompt.tokens), self.context_window)
        return prompt


def _passage_list(passages: Sequence[str] | None) -> list[str]:
    """``passages`` as a list of strings (an empty one is layout, no passage); a lone
    string would otherwise be read as one passage per character."""
    if passages is None:
        return []
    if isinstance(passages, (str, bytes)) or not isinstance(passages, Sequence):
        raise TypeError(f"passages must be a list of str, got {type(passages).__name__}")
    for i, text in enumerate(passages):
        if not isinstance(text, str):
            raise TypeError(f"passages[{i}] is a {type(text).__name__}: pass strings")
    return list(passages)


def _check_message(message: Any, i: int) -> None:
    """A chat message the template can render as the model is meant to read it."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"messages[{i}] must be a dict with 'role', got {message!r}")
    if not isinstance(message["role"], str) or not message["role"]:
        raise ValueError(f"messages[{i}]['role'] must be a non-empty str, got {message['role']!r}")
    if "content" not in message and not message.get("tool_calls"):
        raise ValueError(f"messages[{i}] has neither 'content' nor 'tool_calls'")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(
            f"messages[{i}]['content'] must be a str (or None), got {type(content).__name__}; "
            "join text parts into one string"
        )
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, (list, tuple)):
        raise ValueError(
            f"messages[{i}]['tool_calls'] must be a list of calls, got {type(calls).__name__}"
        )


def _said(message: Message) -> bool:
    """Whether a checked message carries anything: text beyond whitespace, or tool calls."""
    return bool((message.get("content") or "").strip() or message.get("tool_calls"))


def _parse(text: str) -> list[Segment]:
    """``parse_segments``, for valid Unicode only: a lone surrogate fails deep inside the
    tokenizer with a message about its input types."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"the prompt holds a lone surrogate {text[error.start]!r} at character "
            f"{error.start}: pass valid Unicode text"
        ) from None
    return parse_segments(text)


def before_passages(prompt: TokenizedPrompt) -> list[int]:
    """The prompt's tokens before its first passage (all of them when it has none)."""
    return prompt.tokens[: max(prompt.passages[0].offset, 0)] if prompt.passages else prompt.tokens


def _special_prefix(tokenizer: Any) -> list[int]:
    """The tokens the tokenizer puts before any text (BOS for Llama-2 style tokenizers)."""
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    if not plain or plain[0] not in with_special:
        return []
    return list(with_special[: with_special.index(plain[0])])


def anchor_tokens(tokenizer: Any, special_prefix: list[int]) -> list[int]:
    """What passages are encoded after: the special prefix, else BOS, else a newline."""
    if special_prefix:
        return special_prefix
    if tokenizer.bos_token_id is not None:
        return [tokenizer.bos_token_id]
    return list(tokenizer("\n", add_special_tokens=False)["input_ids"])
