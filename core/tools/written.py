"""Calls as the model wrote them: an assistant turn that holds calls this engine returned is
rendered back as the text that made them, so an agent's next prompt continues the last
answer token for token, and that answer's KV (the session cache keeps it) is read rather
than computed again.

Small Qwen2.5-Coder models write calls as bare or fenced JSON where their chat template
renders ``<tool_call>`` tags: the next step's prompt left the answer at its first token, and
LangChain agents' later steps reused 76-80% of their prompt (issue 61). It also shows the
model its own turn, as a ``generate`` loop over the raw text would. A call this engine did
not write (a framework's own, another process's, one whose name, arguments or surrounding
text was changed) is rendered by the template as before.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvboost_rag.core.tools.calls import ToolCall, call_key

# Answers remembered; the oldest goes first, and a forgotten one is rendered by the template.
MAX_WRITTEN = 4096


class WrittenCalls:
    """Each answer that made calls, by the calls' ids: its content, its calls and the text
    it was decoded as. Thread-safe."""

    def __init__(self, limit: int = MAX_WRITTEN) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self._limit = limit
        self._texts: OrderedDict[tuple[str, ...], tuple[str, tuple[str, ...], str]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, text: str, content: str, calls: Sequence[ToolCall]) -> None:
        """``text``, the answer as decoded, made ``calls`` with ``content`` around them."""
        if not calls:
            return
        ids = tuple(c.id for c in calls)
        with self._lock:
            self._texts[ids] = (content.strip(), _keys(calls), text)
            self._texts.move_to_end(ids)
            while len(self._texts) > self._limit:
                self._texts.popitem(last=False)

    def text_of(self, content: str, calls: Sequence[ToolCall]) -> str | None:
        """The text that wrote ``calls`` (with ``content``), if this engine wrote exactly
        them: the same ids, names, arguments and content; else None."""
        with self._lock:
            entry = self._texts.get(tuple(c.id for c in calls))
        if entry is None:
            return None
        written, keys, text = entry
        return text if written == content.strip() and keys == _keys(calls) else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._texts)


def _keys(calls: Sequence[ToolCall]) -> tuple[str, ...]:
    return tuple(call_key(c.name, c.arguments) for c in calls)
