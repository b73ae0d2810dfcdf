"""Essay pieces (the corpus ``kvboost_rag.essays`` locates) and a fact-retrieval task on them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvboost_rag.core.prompt.chunker import format_passages, split_passage
from kvboost_rag.essays import essay_texts

NAMES = [
    "Harbor",
    "Maple",
    "Granite",
    "Willow",
    "Copper",
    "Falcon",
    "Juniper",
    "Ember",
    "Cobalt",
    "Aspen",
    "Meadow",
    "Summit",
    "Orchid",
    "Tundra",
    "Lagoon",
    "Cedar",
    "Basalt",
    "Saffron",
    "Quartz",
    "Heron",
    "Ivory",
    "Marigold",
    "Onyx",
    "Prairie",
]
# What a LangChain RAG question starts with (load, benchmarks.rag.langchain_rag).
QUESTION_PREFIX = "What do the documents say about this: "
SYSTEM_PROMPT = "Answer the question using the documents. Reply with the code only."
COLORS = ["Red", "Blue", "Green", "Silver", "Golden", "Black", "White", "Violet"]


@dataclass(frozen=True)
class FactPassage:
    text: str  # an essay piece with one fact sentence inserted after its first sentence
    question: str
    answer: str


def passages(
    tokenizer: Any, max_tokens: int, count: int, skip: int = 0, min_tokens: int | None = None
) -> list[str]:
    """``count`` essay pieces of at most ~``max_tokens`` tokens (the first ``skip`` dropped),
    each at least ``min_tokens`` long (default half of ``max_tokens``)."""
    floor = max_tokens // 2 if min_tokens is None else min_tokens
    pieces: list[str] = []
    for essay in essay_texts():
        for piece in split_passage(" ".join(essay.split()), tokenizer, max_tokens):
            if len(tokenizer(piece)["input_ids"]) >= floor:
                pieces.append(piece.strip())
        if len(pieces) >= skip + count:
            break  # the pieces come in essay order, so the rest cannot change the answer
    return pieces[skip : skip + count]


def fact_passages(texts: list[str], seed: int) -> list[FactPassage]:
    """Give each text a fact: an invented archive code, asked about by its question.
    Archive names and codes are unique, so exactly one passage answers each question."""
    rng = random.Random(seed)
    names = [f"{c} {n}" for c in COLORS for n in NAMES]
    rng.shuffle(names)
    codes = rng.sample(range(1000, 10000), len(texts))
    out = []
    for text, name, code in zip(texts, names, codes):
        fact = f"The access code for the {name} archive is {code}."
        head, _, rest = text.partition(". ")
        question = f"What is the access code for the {name} archive?"
        out.append(FactPassage(f"{head}. {fact} {rest}", question, str(code)))
    return out


def queries(pool: list[FactPassage], k: int, n: int, seed: int) -> list[tuple[list, FactPassage]]:
    """``n`` queries of ``k`` pool passages: each pool passage in turn is the target,
    among ``k - 1`` random others, in random order."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = pool[i % len(pool)]
        docs = rng.sample([p for p in pool if p is not target], k - 1) + [target]
        rng.shuffle(docs)
        out.append((docs, target))
    return out


def messages_for(docs: list[FactPassage], question: str) -> list[dict[str, str]]:
    body = "Documents:\n\n" + format_passages([d.text for d in docs])
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": body + f"Question: {question}"},
    ]


def warm_prefix() -> list[dict[str, str]]:
    """``messages_for``'s layout with one placeholder passage: what a pool used in its
    prompts is warmed under (``warm_passages(prefix=...)`` takes the part before it)."""
    return messages_for([FactPassage("placeholder", "", "")], "placeholder")
