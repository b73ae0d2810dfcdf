"""An unmarked prompt's paragraphs (``paragraphs.py``) with each family's real tokenizer and
chat template: cut at blank lines and at the template's special tokens, so none spans two
turns or holds a turn marker."""

from __future__ import annotations

import pytest
from families import FAMILIES, family_tokenizer

from kvboost_rag.core.reuse.paragraphs import Breaks, paragraphs, special_ids

INSTRUCTIONS = " ".join(f"Rule {i}: answer with one call of a listed function." for i in range(9))
QUESTION = " ".join(f"Find the weather in city number {i} for tomorrow." for i in range(8))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_paragraph_never_spans_two_turns(name: str) -> None:
    tokenizer = family_tokenizer(name)
    messages = [
        {"role": "system", "content": INSTRUCTIONS},  # no blank line before the next turn
        {"role": "user", "content": QUESTION},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    special = special_ids(tokenizer)
    found = paragraphs(tokens, Breaks(tokenizer))
    texts = [tokenizer.decode(tokens[a:z]) for a, z in found]
    assert not any(t in special for a, z in found for t in tokens[a:z])
    assert any(INSTRUCTIONS in t for t in texts) and any(QUESTION in t for t in texts)
    assert not any(INSTRUCTIONS in t and QUESTION in t for t in texts)


def test_blank_lines_still_cut_within_a_turn() -> None:
    tokenizer = family_tokenizer("qwen2.5")
    text = f"{INSTRUCTIONS}\n\n{QUESTION}"
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    texts = [tokenizer.decode(tokens[a:z]) for a, z in paragraphs(tokens, Breaks(tokenizer))]
    first, second = (t.strip() for t in texts)  # ".\n\n" is one token, layout
    assert first == INSTRUCTIONS.removesuffix(".") and second == QUESTION
