"""From what users pass (text, messages, passages) to the model's tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvboost_rag.core.chunker import (
    TokenizedPrompt,
    format_passages,
    parse_segments,
    tokenize_segments,
)
from kvboost_rag.core.errors import ContextWindowError, EmptyPromptError
from kvboost_rag.core.tool_prompt import render_chat
from kvboost_rag.core.tools import Tool, ToolFormat, format_for

# {"role", "content"}; assistant messages may carry "tool_calls", tool results
# "tool_call_id" / "name" (see core/tool_prompt.py).
Message = dict[str, Any]


class PromptEncoder:
    def __init__(self, tokenizer: Any, context_window: int, max_passage_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.context_window = context_window
        self.max_passage_tokens = max_passage_tokens
        self.special_prefix = _special_prefix(tokenizer)  # e.g. [BOS] where the tokenizer adds it

    def text(self, prompt: str, passages: Sequence[str] | None = None) -> TokenizedPrompt:
        """A completion prompt; ``passages`` are placed before it, each marked as a passage."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt and not passages:
            raise EmptyPromptError("prompt is empty: pass the text to complete")
        return self._checked(format_passages(passages or []) + prompt, self.special_prefix)

    def passages(self, texts: Sequence[str] | str) -> list[list[int]]:
        """Token ids of each passage (piece) to warm: each text of a list is one passage
        (layout around it does not matter), a string is a prompt whose marked passages
        are taken."""
        marked = texts if isinstance(texts, str) else format_passages(texts)
        segments = [s for s in parse_segments(marked) if s.kind == "passage"]
        prompt = tokenize_segments(segments, self.tokenizer, [], self.max_passage_tokens)
        pieces = [prompt.tokens[s:e] for s, e in prompt.passages]
        for piece in pieces:
            if len(piece) >= self.context_window:
                raise ContextWindowError(len(piece), self.context_window, what="a passage")
        return pieces

    def prefix(self, spec: str | Sequence[Message]) -> list[int]:
        """The tokens before the first passage of ``spec``: a completion prompt (all of it
        when it marks no passage) or chat messages that mark where passages go."""
        if isinstance(spec, str):
            prompt = tokenize_segments(
                parse_segments(spec), self.tokenizer, self.special_prefix, self.max_passage_tokens
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
        if not messages:
            raise EmptyPromptError("messages is empty: pass at least one {'role', 'content'} dict")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role', got {message!r}")
            if "content" not in message and not message.get("tool_calls"):
                raise ValueError(f"messages[{i}] has neither 'content' nor 'tool_calls'")
        text = render_chat(self.tokenizer, messages, tools, fmt or self.tool_format())
        # The template already holds the special tokens; adding them again would double BOS.
        return self._checked(text, [])

    def tool_format(self, override: str = "auto") -> ToolFormat:
        """The tool-call format of this tokenizer's chat template (or ``override``)."""
        return format_for(getattr(self.tokenizer, "chat_template", None), override)

    def _checked(self, text: str, prefix: list[int]) -> TokenizedPrompt:
        segments = parse_segments(text)
        prompt = tokenize_segments(segments, self.tokenizer, prefix, self.max_passage_tokens)
        if not prompt.tokens:
            raise EmptyPromptError("prompt has no tokens after tokenization")
        if len(prompt.tokens) >= self.context_window:
            raise ContextWindowError(len(prompt.tokens), self.context_window)
        return prompt


def before_passages(prompt: TokenizedPrompt) -> list[int]:
    """The prompt's tokens before its first passage (all of them when it has none)."""
    return prompt.tokens[: prompt.passages[0][0]] if prompt.passages else prompt.tokens


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
