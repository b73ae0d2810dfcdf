"""The model alone, as a transformers user runs it: the messages through its own chat
template (``tools=`` there), greedy ``generate``, and a plain parser for the calls
(``<tool_call>`` tags, bare or fenced JSON, unconstrained). The baseline arm of the tool
and leaderboard studies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.tools.structure import Structure

Calls = list[tuple[str, dict[str, Any]]]


def plain_answer(
    engine: KVBoost,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    max_tokens: int,
) -> tuple[str, Calls]:
    """The answer's text (calls taken out) and its calls, several allowed."""
    tokenizer = engine.tokenizer
    ids = tokenizer.apply_chat_template(
        list(messages), tools=list(tools), add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    with torch.no_grad():
        out = engine.model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
    for token in (tokenizer.eos_token, "<|im_end|>", "<|endoftext|>"):
        text = text.split(token)[0] if token else text
    parsed = Structure(tuple(tools), constrain=False, parallel=True).parse(text)
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]
