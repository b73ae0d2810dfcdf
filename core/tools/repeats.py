"""The repeat guard: a call identical to one the conversation already holds with its result
is not returned again.

Small local models loop on tools: after a tool's result, Qwen2.5-Coder-0.5B calls the same
tool with the same arguments until the framework's step limit (issue 61). Serving layers
stop such loops (LangChain's ``ToolCallLimitMiddleware``, agent runtimes refusing a second
identical call); here the engine does: an answer whose calls repeat an answered one is
decoded again from where its calls began, with calls refused by the grammar
(``tool_choice="none"``), so the model writes its answer as text. The tools stay in the
prompt, so the retry reads the first try's cached KV.

Calls are compared by name and arguments as canonical JSON: keys sorted, and a float that
is a whole number equal to the int (``2 == 2.0``, as JSON Schema's "integer" counts it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_rag.core.tools.calls import ToolCall, call_key
from kvboost_rag.core.tools.template import as_call


def answered_calls(messages: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The calls (``call_key``) that assistant messages made since the last user message
    and a later tool message answered: by ``tool_call_id`` where the results name one,
    else any tool message after the call answers it (templates that drop ids). A call
    made for an earlier question may be made again for a new one."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    answered: set[str] = set()
    for i, message in enumerate(messages):
        if users and i < users[-1]:
            continue
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            continue
        results = [m for m in messages[i + 1 :] if m.get("role") == "tool"]
        ids = {m.get("tool_call_id") for m in results} - {None}
        for raw in message.get("tool_calls") or []:
            call = as_call(raw)
            given_id = isinstance(raw, ToolCall) or (isinstance(raw, Mapping) and "id" in raw)
            if call.id in ids or (results and not (ids and given_id)):
                answered.add(call_key(call.name, call.arguments))
    return frozenset(answered)


@dataclass(frozen=True)
class RepeatGuard:
    """One request's guard: the calls its conversation already answered."""

    answered: frozenset[str]

    def repeated(self, calls: Iterable[ToolCall]) -> list[ToolCall]:
        """The calls among ``calls`` that repeat an answered one."""
        return [c for c in calls if call_key(c.name, c.arguments) in self.answered]


def kept_tokens(ids: Sequence[int], content: str, decode: Callable[[list[int]], str]) -> int:
    """How many of an answer's first tokens write its ``content`` before the calls: the
    most whose text is a prefix of ``content`` (the retry goes on after them)."""
    target = content.rstrip()
    if not target:
        return 0
    lo, hi = 0, len(ids)  # the text of ids[:n] grows with n: search the last that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        text = decode(list(ids[:mid]))
        if target.startswith(text.rstrip()) and len(text.rstrip()) <= len(target):
            lo = mid
        else:
            hi = mid - 1
    return lo
