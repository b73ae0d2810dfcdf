"""The LangChain adapters on a tiny random fp32 Llama: what reaches the engine, what comes
back, streaming, async, callbacks, options and bad input."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from conftest import make_model
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import FunctionMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from pydantic import ValidationError

from kvboost_rag import EmptyPromptError, KVBoost, KVBoostConfig, MarkerError, passage
from kvboost_rag.integrations.langchain import (
    ChatKVBoost,
    KVBoostPipeline,
    KVBoostTextSplitter,
    format_passages,
    stuff_documents_kwargs,
)

DOCS = [
    Document(page_content="Paris is the capital of France and sits on the Seine."),
    Document(page_content="The Nile flows north through Egypt into the Mediterranean."),
    Document(page_content="Mount Fuji is the highest mountain in Japan."),
]
QUESTION = "Which river flows north?"


@pytest.fixture
def engine(tokenizer) -> KVBoost:
    # "fast" reuses every passage token as is, so reuse counts are exact to assert on;
    # the repair levels are tested in test_passage_reuse.py.
    return KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8, fidelity="fast"))


@pytest.fixture
def chat(engine: KVBoost) -> ChatKVBoost:
    return ChatKVBoost(engine=engine, max_tokens=12)


@pytest.fixture
def llm(engine: KVBoost) -> KVBoostPipeline:
    return KVBoostPipeline(engine=engine, max_tokens=12)


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def test_documents_reach_the_engine_as_passages_before_the_last_user_message(
    chat: ChatKVBoost, engine: KVBoost
) -> None:
    first = chat.invoke([("system", "Be brief."), ("human", QUESTION)], documents=DOCS)
    expected = engine.tokenize_chat(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": format_passages(DOCS) + QUESTION},
        ]
    )
    assert first.usage_metadata["input_tokens"] == len(expected)
    assert first.response_metadata["passages_missed"] == len(DOCS)
    again = chat.invoke([("system", "Be brief."), ("human", QUESTION)], documents=DOCS[::-1])
    meta = again.response_metadata
    assert (meta["passages_hit"], meta["passages_missed"]) == (len(DOCS), 0)
    passage_tokens = sum(len(engine.tokenize(format_passages([d]))) for d in DOCS)
    assert again.usage_metadata["input_token_details"]["cache_read"] >= passage_tokens
    assert meta["ttft_ms"] > 0 and 0 < meta["kv_reuse_ratio"] <= 1


def test_bound_documents_equal_passed_documents(chat: ChatKVBoost) -> None:
    bound = chat.bind(documents=DOCS).invoke(QUESTION)
    direct = chat.invoke(QUESTION, documents=DOCS)
    assert bound.content == direct.content
    assert bound.usage_metadata["input_tokens"] == direct.usage_metadata["input_tokens"]


def test_stream_deltas_join_to_invoke_and_reach_callbacks(chat: ChatKVBoost) -> None:
    expected = chat.invoke(QUESTION)
    handler = Tokens()
    chunks = list(chat.stream(QUESTION, config={"callbacks": [handler]}))
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    assert full.content == expected.content
    assert "".join(handler.tokens) == expected.content
    assert chunks[-1].chunk_position == "last"
    assert full.usage_metadata["output_tokens"] == expected.usage_metadata["output_tokens"]
    assert sum(bool(c.usage_metadata) for c in chunks) == 1


def test_streaming_field_streams_through_invoke(engine: KVBoost) -> None:
    handler = Tokens()
    streaming = ChatKVBoost(engine=engine, max_tokens=12, streaming=True)
    result = streaming.invoke(QUESTION, config={"callbacks": [handler]})
    assert len(handler.tokens) > 1 and "".join(handler.tokens) == result.content


async def test_async_calls_match_sync_and_leave_the_loop_running(chat: ChatKVBoost) -> None:
    expected = chat.invoke(QUESTION).content
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    result = await chat.ainvoke(QUESTION)
    ticks_during_invoke = ticks
    parts = [chunk.content async for chunk in chat.astream(QUESTION)]
    task.cancel()
    assert result.content == "".join(parts) == expected
    assert ticks_during_invoke > 0


async def test_concurrent_async_calls_get_their_own_answers(chat: ChatKVBoost) -> None:
    questions = ["Which river flows north?", "What is the capital of France?"]
    serial = [chat.invoke(q).content for q in questions]
    together = await asyncio.gather(*(chat.ainvoke(q) for q in questions))
    assert [m.content for m in together] == serial


def test_threads_share_one_engine_safely(engine: KVBoost) -> None:
    chats = [ChatKVBoost(engine=engine, max_tokens=10) for _ in range(2)]
    questions = ["Tell me about Paris.", "Tell me about the Nile."]
    serial = [c.invoke(q).content for c, q in zip(chats, questions)]
    results: list[str] = ["", ""]

    def ask(i: int) -> None:
        results[i] = chats[i].invoke(questions[i]).content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == serial


def test_stop_and_sampling_options_reach_the_engine(chat: ChatKVBoost) -> None:
    full = chat.invoke(QUESTION).content
    stop = full[3:5]
    assert stop and full.find(stop) >= 0
    assert chat.invoke(QUESTION, stop=[stop]).content == full[: full.find(stop)]
    assert (
        ChatKVBoost(engine=chat.engine, stop=[stop], max_tokens=12).invoke(QUESTION).content
        == (full[: full.find(stop)])
    )
    short = chat.invoke(QUESTION, max_tokens=2)
    assert short.usage_metadata["output_tokens"] == 2
    seeded = [chat.invoke(QUESTION, temperature=1.0, seed=7).content for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_llm_generation_info_and_usage(llm: KVBoostPipeline, engine: KVBoost) -> None:
    prompt = "Context: " + format_passages(DOCS) + QUESTION
    # A batch's prompts run at once, so one cannot read the passages another encodes after
    # its answer: a first call leaves them cached.
    cold = llm.generate([prompt + " Briefly."]).generations[0][0].generation_info
    assert cold["passages_missed"] == len(DOCS)
    result = llm.generate([prompt, "Context: " + format_passages(DOCS[::-1]) + QUESTION])
    first, second = (g[0].generation_info for g in result.generations)
    # the same layout comes from the exact prefix cache, the reordered one from passages
    assert first["reused_tokens"] > 0 and second["passages_hit"] == len(DOCS)
    assert first["prompt_tokens"] == len(engine.tokenize(prompt))
    usage = result.llm_output["token_usage"]
    assert usage["prompt_tokens"] == 2 * first["prompt_tokens"]
    assert usage["cached_tokens"] == first["reused_tokens"] + second["reused_tokens"]


def test_llm_documents_streaming_and_async_agree(llm: KVBoostPipeline, engine: KVBoost) -> None:
    expected = llm.invoke(QUESTION, documents=DOCS)
    assert (
        expected
        == engine.generate(
            QUESTION, passages=[d.page_content for d in DOCS], max_new_tokens=12
        ).text
    )
    handler = Tokens()
    assert "".join(llm.stream(QUESTION, documents=DOCS, config={"callbacks": [handler]})) == (
        expected
    )
    assert "".join(handler.tokens) == expected
    streaming = KVBoostPipeline(engine=engine, max_tokens=12, streaming=True)
    assert streaming.invoke(QUESTION, documents=DOCS) == expected
    assert asyncio.run(llm.ainvoke(QUESTION, documents=DOCS)) == expected
    assert asyncio.run(streaming.ainvoke(QUESTION, documents=DOCS)) == expected


def test_stuff_documents_prompt_marks_each_document(chat: ChatKVBoost, engine: KVBoost) -> None:
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{input}")]
    )
    chain = create_stuff_documents_chain(chat, prompt, **stuff_documents_kwargs())
    engine.warm_passages([d.page_content for d in DOCS])
    before = engine.stats().reused_tokens
    chain.invoke({"context": DOCS[::-1], "input": QUESTION})
    passage_tokens = sum(len(engine.tokenizer(d.page_content)["input_ids"]) for d in DOCS)
    assert engine.stats().reused_tokens - before >= passage_tokens


def test_bad_input_gets_specific_errors(chat: ChatKVBoost, engine: KVBoost) -> None:
    with pytest.raises(ValidationError, match="extra"):
        ChatKVBoost(engine=engine, timeout=3)
    with pytest.raises(ValidationError, match="engine=, not both"):
        ChatKVBoost(engine=engine, model_id="other")
    with pytest.raises(ValidationError, match="differs from the wrapped engine"):
        ChatKVBoost(engine=engine, fidelity="exact")
    with pytest.raises(ValidationError, match="temperature"):
        ChatKVBoost(engine=engine, temperature=-1)
    with pytest.raises(ValidationError, match="stop"):
        ChatKVBoost(engine=engine, stop=[""])
    with pytest.raises(TypeError, match="unknown option"):
        chat.invoke(QUESTION, top_n=3)
    with pytest.raises(ValueError, match="cannot switch"):
        chat.invoke(QUESTION, model="gpt-4")
    with pytest.raises(ValueError, match="only text"):
        chat.invoke([HumanMessage(content=[{"type": "image", "url": "x"}])])
    with pytest.raises(ValueError, match="FunctionMessage"):
        chat.invoke([FunctionMessage("4", name="add")])
    with pytest.raises(ValueError, match="needs a user message"):
        chat.invoke([SystemMessage("hi")], documents=DOCS)
    with pytest.raises(MarkerError):
        chat.invoke(QUESTION, documents=[passage("already marked")])
    # A blank document is skipped with a warning, as warm_corpus skips it (issue 48).
    with pytest.warns(UserWarning, match=r"skipping documents\[0\]: it is empty"):
        assert chat.invoke(QUESTION, documents=[Document(page_content="")]).content is not None


def test_splitter_chunks_are_whole_kv_units(engine: KVBoost, tokenizer) -> None:
    text = " ".join(f"Sentence number {i} talks about topic {i % 5}." for i in range(60))
    splitter = KVBoostTextSplitter(engine, chunk_size=64, add_start_index=True)
    docs = splitter.create_documents([text])
    assert len(docs) > 1
    assert " ".join(d.page_content for d in docs) == text
    for doc in docs:
        assert text[doc.metadata["start_index"] :].startswith(doc.page_content)
        # The chunk plus the separator format_passages adds is one passage, never split.
        marked = engine.tokenize(format_passages([doc]))
        assert len(marked) <= 64
        assert len(engine._prompts.passages([doc.page_content])) == 1
    assert KVBoostTextSplitter(ChatKVBoost(engine=engine))._chunk_size == 512
    with pytest.raises(ValueError, match="chunk_size"):
        KVBoostTextSplitter(engine, chunk_size=10_000)
    with pytest.raises(ValueError, match="chunk_overlap"):
        KVBoostTextSplitter(engine, chunk_overlap=20)
    with pytest.raises(TypeError, match="KVBoost engine"):
        KVBoostTextSplitter(tokenizer)


@pytest.mark.parametrize(
    "empty", ["", "   \n\t ", [HumanMessage("  ")], [SystemMessage(" "), HumanMessage("\n")]]
)
def test_whitespace_only_input_is_an_empty_prompt(
    chat: ChatKVBoost, llm: KVBoostPipeline, empty: Any
) -> None:
    """invoke("") answered: the chat template alone is not a prompt."""
    with pytest.raises(EmptyPromptError):
        chat.invoke(empty)
    with pytest.raises(EmptyPromptError):
        list(chat.stream(empty))
    if isinstance(empty, str):
        with pytest.raises(EmptyPromptError):
            llm.invoke(empty)


def test_a_bad_max_tokens_is_named_as_it_was_passed(
    chat: ChatKVBoost, llm: KVBoostPipeline
) -> None:
    """invoke(..., max_tokens=0) said "max_new_tokens must be ...", a name the caller never
    used."""
    for model in (chat, llm):
        for bad in (0, -3, True, 2.5):
            with pytest.raises(ValueError, match=rf"^max_tokens must be an int >= 1, got {bad!r}$"):
                model.invoke(QUESTION, max_tokens=bad)


@pytest.mark.parametrize("text", ["word " * 2000, "z" * 3000])
def test_splitter_keeps_chunk_size_without_sentence_ends(engine: KVBoost, text: str) -> None:
    chunks = KVBoostTextSplitter(engine, chunk_size=32).split_text(text)
    assert len(chunks) > 60  # was one chunk of the whole text
    assert (
        max(len(engine.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chunks) <= 32
    )
    assert "".join(chunks).replace(" ", "") == text.replace(" ", "")  # only edges stripped


def test_token_counts_and_tracing_params(
    chat: ChatKVBoost, llm: KVBoostPipeline, tokenizer
) -> None:
    text = "Hello there"
    expected = len(tokenizer(text, add_special_tokens=False).input_ids)
    assert chat.get_num_tokens(text) == llm.get_num_tokens(text) == expected
    assert chat._get_ls_params()["ls_model_type"] == "chat"
    params = llm._get_ls_params(stop=["x"], max_tokens=3)
    assert params["ls_model_type"] == "llm" and params["ls_provider"] == "kvboost_rag"
    assert (params["ls_stop"], params["ls_max_tokens"]) == (["x"], 3)


def test_lcel_format_passages_marks_retrieved_documents(chat: ChatKVBoost, engine: KVBoost) -> None:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    prompt = ChatPromptTemplate.from_messages(
        [("system", "Context:\n{context}"), ("human", "{question}")]
    )
    orders = iter([DOCS, DOCS[::-1]])
    retriever = RunnableLambda(lambda _question: next(orders))
    chain = (
        {"context": retriever | format_passages, "question": RunnablePassthrough()}
        | prompt
        | chat
        | StrOutputParser()
    )
    assert isinstance(chain.invoke(QUESTION), str)
    before = engine.stats().reused_tokens
    chain.invoke(QUESTION)  # the same documents in reverse order: every passage is a hit
    passage_tokens = sum(len(engine.tokenize(format_passages([d]))) for d in DOCS)
    assert engine.stats().reused_tokens - before >= passage_tokens


def test_odd_values_fuzzing_found(chat: ChatKVBoost, llm: KVBoostPipeline, engine: KVBoost) -> None:
    with pytest.raises(TypeError, match="documents must be a list .* got str"):
        chat.invoke(QUESTION, documents="abc")  # was three one-letter passages
    with pytest.raises(ValueError, match="stop must be a str"):
        llm.invoke(QUESTION, stop=5)  # was "'int' object is not iterable" in _get_ls_params
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1, got True"):
        chat.invoke(QUESTION, max_tokens=True)  # was 1 token
    bad_fields = ({"max_tokens": True}, {"top_k": True}, {"temperature": float("inf")})
    for field in (*bad_fields, {"seed": 2**64}):
        with pytest.raises(ValidationError):  # True was read as 1; inf and 2**64 were taken
            ChatKVBoost(engine=engine, **field)
