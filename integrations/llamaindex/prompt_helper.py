"""``PassagePromptHelper``: LlamaIndex's packing and truncation, at passage boundaries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from llama_index.core.indices.prompt_helper import DEFAULT_PADDING, PromptHelper
from llama_index.core.prompts import BasePromptTemplate

from kvboost_rag.core.prompt.chunker import CLOSE, OPEN, PASSAGE_SEPARATOR, parse_segments, passage
from kvboost_rag.integrations.llamaindex.llm import KVBoostLLM


class _ModelTokens:
    """The model's token ids for text as the engine sees it (markers removed)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        plain = text.replace(OPEN, "").replace(CLOSE, "")
        return list(self.tokenizer(plain, add_special_tokens=False)["input_ids"])


class PassagePromptHelper(PromptHelper):
    """Packs and truncates text chunks at passage boundaries only, never inside a passage.

    ``repack`` (compact, refine, tree_summarize) groups whole passages into as few chunks
    as fit the window; ``truncate`` (simple_summarize) drops the passages that do not fit.
    A passage longer than the room stays whole in a chunk of its own (the engine raises
    ``ContextWindowError`` if it cannot fit the model). Chunks without passages (tree
    summaries) go through LlamaIndex's own splitting.
    """

    @classmethod
    def from_llm(cls, llm: KVBoostLLM, **kwargs: Any) -> PassagePromptHelper:
        meta = llm.metadata
        return cls(
            context_window=meta.context_window - _template_tokens(llm),
            num_output=meta.num_output,
            tokenizer=_ModelTokens(llm.engine.tokenizer),
            **kwargs,
        )  # type: ignore[call-arg]

    def repack(
        self,
        prompt: BasePromptTemplate,
        text_chunks: Sequence[str],
        padding: int = DEFAULT_PADDING,
        llm: Any = None,
        tools: Any = None,
    ) -> list[str]:
        if not any(OPEN in chunk for chunk in text_chunks):
            return super().repack(prompt, text_chunks, padding, llm, tools)
        room = self._get_available_chunk_size(prompt, 1, padding, llm, tools)
        return _pack(_units(text_chunks), room, self._token_counter.get_string_tokens)

    def truncate(
        self,
        prompt: BasePromptTemplate,
        text_chunks: Sequence[str],
        padding: int = DEFAULT_PADDING,
        llm: Any = None,
        tools: Any = None,
    ) -> list[str]:
        if not any(OPEN in chunk for chunk in text_chunks):
            return super().truncate(prompt, text_chunks, padding, llm, tools)
        room = self._get_available_chunk_size(prompt, len(text_chunks), padding, llm, tools)
        count = self._token_counter.get_string_tokens
        return _JoinedText(_pack(_units([chunk]), room, count)[0] for chunk in text_chunks)


class _JoinedText(list):  # type: ignore[type-arg]
    """simple_summarize formats the list ``truncate`` returns straight into ``context_str``
    (``str(list)``: brackets, quotes and escaped newlines, so no passage would match its
    cached tokens). As text, this list is its items joined."""

    def __str__(self) -> str:
        return "".join(self)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _template_tokens(llm: KVBoostLLM) -> int:
    """Tokens a chat template adds around the messages LlamaIndex counts (its default
    system prompt included), kept free so packed chunks fit the model. Measured around a
    one-character message (a blank one is no prompt the engine takes): at most a token
    more than the template alone, which only keeps that much more room free."""
    if not llm.metadata.is_chat_model:
        return 0
    return len(llm.engine.tokenize_chat([{"role": "user", "content": "x"}]))


class _Unit(NamedTuple):
    text: str  # a marked passage with the text in front of it
    starts_chunk: bool  # the first unit of an input chunk: joined after a blank line


def _units(chunks: Sequence[str]) -> list[_Unit]:
    """Each marked passage with the text in front of it (separators, a node's metadata
    header); text after a chunk's last passage ends that unit. A chunk's units join back
    to its text; chunks join with a blank line, as LlamaIndex joins them."""
    units: list[_Unit] = []
    for chunk in chunks:
        lead, first = "", len(units)
        for segment in parse_segments(chunk.strip()):
            if segment.kind == "passage":
                units.append(_Unit(lead + passage(segment.text), len(units) == first))
                lead = ""
            else:
                lead += segment.text
        if lead and len(units) > first:
            units[-1] = _Unit(units[-1].text + lead, units[-1].starts_chunk)
        elif lead:  # a chunk without passages
            units.append(_Unit(lead, True))
    return units


def _pack(units: list[_Unit], room: int, count: Callable[[str], int]) -> list[str]:
    """Consecutive units joined into chunks of at most ``room`` tokens, in order."""
    chunks: list[str] = []
    current, used = "", 0
    for unit in units:
        text = PASSAGE_SEPARATOR + unit.text if current and unit.starts_chunk else unit.text
        size = count(text)
        if current and used + size > room:
            chunks.append(current)
            current, used, text = "", 0, unit.text
            size = count(text)
        current, used = current + text, used + size
    if current or not chunks:
        chunks.append(current)
    return chunks
