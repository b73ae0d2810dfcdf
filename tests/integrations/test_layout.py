"""A passage is found whatever surrounds it: every route a passage can arrive by, warmed by
``warm_corpus`` or first seen in any other route's prompt, hits the passage cache on the
next prompt, and the model's input tokens are exactly the prompt's text."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import make_model  # noqa: E402
from langchain_classic.chains.combine_documents import create_stuff_documents_chain  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from llama_index.core.schema import NodeWithScore, TextNode  # noqa: E402

from kvboost_rag import KVBoost, KVBoostConfig, format_passages, passage, warm_corpus  # noqa: E402
from kvboost_rag.core.prompt.chunker import CLOSE, OPEN  # noqa: E402
from kvboost_rag.integrations import langchain as lc  # noqa: E402
from kvboost_rag.integrations.llamaindex import KVBoostLLM, passage_synthesizer  # noqa: E402

TEXTS = [
    "The lighthouse keeper logged every ship that passed the northern cape.",
    "Copper roofs turn green because the metal slowly reacts with the air.",
    "Bees dance to tell the hive where the best flowers are found.",
]
QUESTION = "What turns copper green?"
SYSTEM = "Answer from the documents."


class Seen:
    """Wraps the engine's request methods: each request's rendered prompt and result."""

    def __init__(self, engine: KVBoost) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], Any]] = []
        for name in ("generate", "chat", "stream", "stream_chat"):
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(prompt: Any, **options: Any) -> Any:
            chat = name in ("chat", "stream_chat")
            text = _chat_text(self.engine, prompt) if chat else _text(self.engine, prompt, options)
            tokens = (
                self.engine.tokenize_chat(prompt)
                if chat
                else self.engine.tokenize(prompt, passages=options.get("passages"))
            )
            assert self.engine.tokenizer.decode(tokens) == _unmarked(text)
            out = method(prompt, **options)
            self.calls.append((tokens, out))
            return out

        return call

    def last(self) -> Any:
        out = self.calls[-1][1]
        return getattr(out, "result", None) or out


def _unmarked(text: str) -> str:
    return text.replace(OPEN, "").replace(CLOSE, "")


def _text(engine: KVBoost, prompt: str, options: dict[str, Any]) -> str:
    special = engine.tokenizer.decode(engine.tokenize("x"))[:-1]  # e.g. BOS, when it adds one
    return special + format_passages(options.get("passages") or []) + prompt


def _chat_text(engine: KVBoost, messages: Any) -> str:
    return str(
        engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


# -- the routes ---------------------------------------------------------------------------


def via_format_passages(engine: KVBoost) -> None:
    engine.generate("Documents:\n" + format_passages(TEXTS) + QUESTION, max_new_tokens=2)


def via_passage_markers(engine: KVBoost) -> None:
    context = "\n\n".join(passage(t) for t in TEXTS)  # the README's "mark them yourself"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {QUESTION}"},
    ]
    engine.chat(messages, max_new_tokens=2)


def via_passages_argument(engine: KVBoost) -> None:
    engine.generate(QUESTION, passages=TEXTS, max_new_tokens=2)


def via_documents_argument(engine: KVBoost) -> None:
    chat = lc.ChatKVBoost(engine=engine, max_tokens=2)
    chat.invoke([("system", SYSTEM), ("human", QUESTION)], documents=_documents())


def via_stuff_documents_chain(engine: KVBoost) -> None:
    chat = lc.ChatKVBoost(engine=engine, max_tokens=2)
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM + "\n\n{context}"), ("human", "{input}")]
    )
    chain = create_stuff_documents_chain(chat, prompt, **lc.stuff_documents_kwargs())
    chain.invoke({"context": _documents(), "input": QUESTION})


def via_plain_lcel(engine: KVBoost) -> None:
    llm = lc.KVBoostPipeline(engine=engine, max_tokens=2)
    prompt = ChatPromptTemplate.from_template("Context:\n{context}\nQuestion: {question}")
    chain = {"context": lambda q: lc.format_passages(_documents()), "question": lambda q: q}
    (chain | prompt | llm).invoke(QUESTION)


def via_llamaindex_synthesizer(engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=engine, max_tokens=2)
    nodes = [
        NodeWithScore(node=TextNode(text=t, metadata={"source": f"doc-{i}.txt"}), score=1.0)
        for i, t in enumerate(TEXTS)
    ]
    passage_synthesizer(llm, "compact").synthesize(QUESTION, nodes)


def via_warm_corpus(engine: KVBoost) -> None:
    warm_corpus(engine, [Document(page_content=t) for t in TEXTS], progress=False)


def _documents() -> list[Document]:
    return [Document(page_content=t) for t in TEXTS]


PROMPT_ROUTES = [
    via_format_passages,
    via_passage_markers,
    via_passages_argument,
    via_documents_argument,
    via_stuff_documents_chain,
    via_plain_lcel,
    via_llamaindex_synthesizer,
]


@pytest.fixture
def engine(tokenizer) -> KVBoost:  # type: ignore[no-untyped-def]
    model = make_model("llama")
    # LlamaIndex's default prompts take ~500 tokens of this one-token-per-character
    # tokenizer; default RoPE does not depend on this field, so the model is unchanged.
    model.config.max_position_embeddings = 2048
    return KVBoost(model, tokenizer, KVBoostConfig(block_tokens=8, fidelity="fast"))


@pytest.mark.parametrize("route", PROMPT_ROUTES, ids=lambda r: r.__name__)
@pytest.mark.parametrize(
    "first", [via_warm_corpus, *PROMPT_ROUTES], ids=lambda r: f"after-{r.__name__}"
)
def test_every_route_hits_passages_another_route_cached(
    engine: KVBoost, route: Callable[[KVBoost], None], first: Callable[[KVBoost], None]
) -> None:
    seen = Seen(engine)
    first(engine)
    route(engine)
    result = seen.last()
    # "fast" keeps every reused passage token: all of the passages' tokens came from cache
    passage_tokens = sum(len(engine.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert result.passages_missed == 0 and result.reused_tokens >= passage_tokens
    if route is not first:  # the same prompt again is an exact-prefix hit, even better
        assert result.passages_hit == len(TEXTS)
