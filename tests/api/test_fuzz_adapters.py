"""Property-based fuzzing (hypothesis) of both adapters (LangChain's LLM and chat model,
LlamaIndex's LLM), of blank input on every route a prompt or document takes, and of the
splitters: the same property as ``test_fuzz_api`` (a well-formed answer or a clear error
from the package's own code), 40 examples a property, 2,000 under
HYPOTHESIS_PROFILE=thorough."""

from __future__ import annotations

import operator
import re
import string
from collections.abc import Callable
from functools import reduce
from typing import Any

import pytest
from conftest import assert_clear, run_thorough
from fuzzing import (
    ALPHABET,
    ANY_TEXT,
    CALL,
    FINISH,
    JUNK,
    MAX_NEW,
    ODD_TEXT,
    PROMPT,
    TEXT_PROMPT,
    WORDS,
    attempt,
    deadline,
    fuzz_engine,
    sampling,
    stops_of,
)
from hypothesis import given
from hypothesis import strategies as st
from langchain_core.documents import Document
from llama_index.core.schema import TextNode

from kvboost_rag import EmptyPromptError, KVBoost, passage

# -- the adapters -------------------------------------------------------------------------

ODD_METADATA = st.dictionaries(WORDS, WORDS | JUNK, max_size=2)
DOCUMENTS = (
    st.none()
    | st.none()
    | st.lists(WORDS, min_size=1, max_size=3)
    | st.lists(
        st.builds(lambda t, m: Document(page_content=t, metadata=m), WORDS, ODD_METADATA)
        | st.builds(lambda t, m: TextNode(text=t, metadata=m), WORDS, ODD_METADATA),
        min_size=1,
        max_size=3,
    )
    | st.lists(
        WORDS
        | ANY_TEXT
        | ODD_TEXT
        | st.builds(lambda t: Document(page_content=t), TEXT_PROMPT | ODD_TEXT)
        | st.builds(lambda t: TextNode(text=t), TEXT_PROMPT | ODD_TEXT)
        | JUNK,
        max_size=3,
    )
    | WORDS  # a lone string, not a list
    | JUNK
)
# The adapters' per-call options: ``max_tokens``; None keeps the field's value.
ADAPTER_SAMPLING = sampling("max_tokens", none_refused=False)
CALL_BLOCKS = st.lists(
    WORDS
    | st.just({"type": "text", "text": "hi"})
    | st.just({"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}})
    | st.just({"text": "a block without a type"}),
    max_size=2,
)
LC_KINDS = ("system", "human", "ai", "ai_call", "tool", "chat", "function")


def lc_message(kind: str, content: Any, role: str) -> Any:
    from langchain_core import messages as lc

    if kind == "chat":
        return lc.ChatMessage(role=role, content=content)
    if kind == "ai_call":
        call = {"name": "lookup", "args": {"q": "x"}, "id": "call_1"}
        return lc.AIMessage(content=content, tool_calls=[call])
    if kind == "tool":
        return lc.ToolMessage(content=content, tool_call_id="call_1")
    if kind == "function":
        return lc.FunctionMessage(content=content, name="lookup")
    cls = {"system": lc.SystemMessage, "human": lc.HumanMessage, "ai": lc.AIMessage}[kind]
    return cls(content=content)


LC_MESSAGE = st.builds(
    lc_message,
    st.sampled_from(LC_KINDS),
    WORDS | ANY_TEXT | ODD_TEXT | st.just(passage("a marked passage")) | CALL_BLOCKS,
    st.sampled_from(["user", "assistant", "wizard", ""]),
)
LC_INPUT = (
    WORDS
    | st.lists(st.builds(lambda t: lc_message("human", t, ""), WORDS), min_size=1, max_size=2)
    | st.lists(LC_MESSAGE, max_size=3)
)


def li_message(role: str, content: Any, extra: dict[str, Any], block: Any) -> Any:
    from llama_index.core.base.llms.types import ChatMessage

    message = ChatMessage(role=role, content=content, additional_kwargs=extra)
    if block is not None:
        message.blocks.append(block)
    return message


def li_block(kind: str) -> Any:
    from llama_index.core.base.llms.types import ImageBlock, ToolCallBlock

    if kind == "image":
        return ImageBlock(url="http://example.invalid/x.png")
    return ToolCallBlock(tool_name="lookup", tool_kwargs={"good": {"q": "x"}, "bad": "{bad"}[kind])


LI_ROLES = ("system", "developer", "user", "assistant", "function", "tool", "model")
LI_MESSAGES = st.lists(
    st.builds(li_message, st.sampled_from(LI_ROLES), WORDS, st.just({}), st.none()),
    min_size=1,
    max_size=2,
) | st.lists(
    st.builds(
        li_message,
        st.sampled_from(LI_ROLES),
        WORDS | ANY_TEXT | ODD_TEXT | st.none(),
        st.just({})
        | st.fixed_dictionaries({"tool_call_id": WORDS | JUNK})
        | st.fixed_dictionaries({"tool_calls": st.lists(CALL, max_size=2)}),
        st.none() | st.sampled_from(["image", "good", "bad"]).map(li_block),
    ),
    max_size=3,
)


def check_text(text: Any, stop: Any) -> None:
    assert isinstance(text, str)
    assert not any(s in text for s in stops_of({"stop": stop}))


def check_stats(stats: dict[str, Any], max_tokens: Any) -> None:
    most = int(max_tokens) if max_tokens is not None else MAX_NEW
    assert stats["finish_reason"] in FINISH
    assert 1 <= stats["completion_tokens"] <= most
    assert stats["reused_tokens"] + stats["recomputed_tokens"] == stats["prompt_tokens"]


@pytest.fixture(scope="module")
def engine() -> KVBoost:
    return fuzz_engine()


@pytest.fixture(scope="module")
def lc_llm(engine: KVBoost) -> Any:
    from kvboost_rag.integrations.langchain import KVBoostPipeline

    return KVBoostPipeline(engine=engine, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def lc_chat(engine: KVBoost) -> Any:
    from kvboost_rag.integrations.langchain import ChatKVBoost

    return ChatKVBoost(engine=engine, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def li_llm(engine: KVBoost) -> Any:
    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    return KVBoostLLM(engine=engine, max_tokens=MAX_NEW)


@given(
    prompt=TEXT_PROMPT | ODD_TEXT,  # LangChain refuses other input (its own ValueError) itself
    documents=DOCUMENTS,
    sampled=ADAPTER_SAMPLING,
    how=st.sampled_from(["invoke", "stream", "batch"]),
)
def test_langchain_llm_answers_or_refuses_clearly(lc_llm, prompt, documents, sampled, how):
    options, refused = sampled
    stop = options.pop("stop", None)
    kwargs = {**options, **({} if documents is None else {"documents": documents})}
    if how == "invoke":
        texts = attempt(lambda: [lc_llm.invoke(prompt, stop=stop, **kwargs)])
    elif how == "stream":
        texts = attempt(lambda: ["".join(lc_llm.stream(prompt, stop=stop, **kwargs))])
    else:
        texts = attempt(lambda: lc_llm.batch([prompt, prompt], stop=stop, **kwargs))
    assert texts is None or not refused, f"accepted {options}, stop={stop!r}"
    for text in texts or []:
        check_text(text, stop)


@given(messages=LC_INPUT, documents=DOCUMENTS, sampled=ADAPTER_SAMPLING, stream=st.booleans())
def test_chat_kvboost_answers_or_refuses_clearly(lc_chat, messages, documents, sampled, stream):
    options, refused = sampled
    stop = options.pop("stop", None)
    kwargs = {**options, **({} if documents is None else {"documents": documents})}
    if stream:
        chunks = lambda: reduce(operator.add, lc_chat.stream(messages, stop=stop, **kwargs))  # noqa: E731
        message = attempt(chunks)
    else:
        message = attempt(lambda: lc_chat.invoke(messages, stop=stop, **kwargs))
    assert message is None or not refused, f"accepted {options}, stop={stop!r}"
    if message is not None:
        check_text(message.content, stop)
        check_stats(message.response_metadata, options.get("max_tokens"))
        usage = message.usage_metadata
        assert usage["input_tokens"] + usage["output_tokens"] == usage["total_tokens"]


@given(prompt=PROMPT, sampled=ADAPTER_SAMPLING, stream=st.booleans())
def test_llamaindex_complete_answers_or_refuses_clearly(li_llm, prompt, sampled, stream):
    method = li_llm.stream_complete if stream else li_llm.complete
    response = li_answer(method, prompt, sampled, stream)
    if response is not None:
        check_text(response.text, sampled[0].get("stop"))


@given(messages=LI_MESSAGES, sampled=ADAPTER_SAMPLING, stream=st.booleans())
def test_llamaindex_chat_answers_or_refuses_clearly(li_llm, messages, sampled, stream):
    method = li_llm.stream_chat if stream else li_llm.chat
    response = li_answer(method, messages, sampled, stream)
    if response is not None:
        check_text(response.message.content, sampled[0].get("stop"))


def li_answer(method, request, sampled, stream):
    """A LlamaIndex call's (last) response, or None when it refused clearly; a refused
    option must be refused, and an answer's stats must add up."""
    options, refused = sampled
    if stream:
        response = attempt(lambda: list(method(request, **options))[-1])
    else:
        response = attempt(lambda: method(request, **options))
    assert response is None or not refused, f"accepted {options}"
    if response is not None:
        check_stats(response.additional_kwargs, options.get("max_tokens"))
    return response


# -- whitespace everywhere, and the splitters ---------------------------------------------

# Whitespace of every kind Python's str.strip() removes: ASCII, no-break, ideographic, line
# and paragraph separators.
BLANK = st.text(st.sampled_from(" \t\n\r\x0b\x0c\u00a0\u2003\u3000\u2028\u2029"), max_size=8)


def blank_routes(engine, lc_llm, lc_chat, li_llm, blank: str) -> dict[str, Callable[[], Any]]:
    """Every way a prompt or a document reaches the engine, given only ``blank``."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from llama_index.core.base.llms.types import ChatMessage

    from kvboost_rag import warm_corpus

    user = [{"role": "user", "content": blank}]
    return {
        "generate": lambda: engine.generate(blank, max_new_tokens=1),
        "stream": lambda: list(engine.stream(blank, max_new_tokens=1)),
        "passages": lambda: engine.generate(blank, passages=[blank], max_new_tokens=1),
        "marked": lambda: engine.generate(passage(blank) + blank, max_new_tokens=1),
        "warm": lambda: engine.warm(blank),
        "chat": lambda: engine.chat([{"role": "system", "content": blank}, *user]),
        "stream_chat": lambda: list(engine.stream_chat(user, max_new_tokens=1)),
        "logits": lambda: engine.first_token_logits(blank),
        "tokenize": lambda: engine.tokenize(blank),
        "lc_llm": lambda: lc_llm.invoke(blank),
        "lc_chat": lambda: lc_chat.invoke(blank),
        "lc_messages": lambda: lc_chat.invoke([SystemMessage(blank), HumanMessage(blank)]),
        "lc_stream": lambda: list(lc_chat.stream(blank)),
        "li_complete": lambda: li_llm.complete(blank),
        "li_stream": lambda: list(li_llm.stream_complete(blank)),
        "li_chat": lambda: li_llm.chat([ChatMessage(role="user", content=blank)]),
        "warm_corpus": lambda: warm_corpus(engine, [blank], progress=False),
        "warm_passages": lambda: engine.warm_passages(["Fine text.", blank]),
    }


# Skipped with a warning naming the document (issue 48: the CLI skips a blank file so).
DOCUMENT_ROUTES = {"warm_corpus", "warm_passages"}


@given(blank=BLANK, route=st.sampled_from(sorted(blank_routes(*[None] * 4, ""))))
def test_whitespace_only_input_is_refused_everywhere(
    engine, lc_llm, lc_chat, li_llm, blank: str, route: str
) -> None:
    call = blank_routes(engine, lc_llm, lc_chat, li_llm, blank)[route]
    if route in DOCUMENT_ROUTES:
        with deadline(), pytest.warns(UserWarning, match=r"skipping (documents|texts)\[\d\]"):
            assert call().skipped == 1
        return
    with deadline():
        try:
            call()
        except Exception as error:  # the property inspects every error
            assert_clear(error)
            assert isinstance(error, EmptyPromptError), f"{route}: {type(error).__name__}: {error}"
            return
    raise AssertionError(f"{route} accepted {blank!r}")


# Text of the test tokenizer's alphabet, often without a sentence end or a space.
NO_BOUNDARY = st.text(string.ascii_letters + string.digits + "-_/", min_size=1, max_size=300)
NO_SENTENCE = st.lists(NO_BOUNDARY, min_size=1, max_size=30).map(" ".join)
SPLIT_TEXT = NO_BOUNDARY | NO_SENTENCE | st.text(ALPHABET, max_size=400)


@given(text=SPLIT_TEXT, size=st.integers(1, 64), which=st.sampled_from(["langchain", "llamaindex"]))
def test_splitters_keep_their_size_on_any_text(engine, text: str, size: int, which: str) -> None:
    """Every chunk fits the size asked for (the tiny tokenizer: one token per character),
    and the chunks are the text, cut at the best boundary there is."""
    if which == "langchain":
        from kvboost_rag.integrations.langchain import KVBoostTextSplitter

        chunks = KVBoostTextSplitter(engine, chunk_size=size, strip_whitespace=False).split_text(
            text
        )
    else:
        from kvboost_rag.integrations.llamaindex import KVBoostNodeParser

        chunks = KVBoostNodeParser.from_engine(engine, max_passage_tokens=size).split_text(text)
    counts = [len(engine.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chunks]
    assert all(0 < n <= size for n in counts), (size, counts)
    # Nothing but whitespace-only pieces left out, nothing repeated, in order.
    assert re.sub(r"\s", "", "".join(chunks)) == re.sub(r"\s", "", text)
    if max(map(len, text.split()), default=0) <= size:  # then no word is cut
        assert [word for chunk in chunks for word in chunk.split()] == text.split()


@pytest.mark.slow
def test_every_property_holds_over_2000_examples() -> None:
    run_thorough(__file__, 6)
