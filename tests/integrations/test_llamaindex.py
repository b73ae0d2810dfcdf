"""The LlamaIndex adapter: the LLM's endpoints and the node parser."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import (  # noqa: E402
    LLMChatEndEvent,
    LLMCompletionEndEvent,
)

from kvboost_rag import (  # noqa: E402
    ContextWindowError,
    EmptyPromptError,
    KVBoost,
    MarkerError,
)
from kvboost_rag.core.prompt.chunker import CLOSE, OPEN  # noqa: E402
from kvboost_rag.integrations.llamaindex import KVBoostLLM, KVBoostNodeParser  # noqa: E402

TEXTS = [
    "The Eiffel Tower stands in Paris. It was finished in 1889 for a world fair.",
    "The Colosseum stands in Rome. It held about fifty thousand people at games.",
    "Big Ben is the great bell of a clock tower in London. It rings every hour.",
]
QUESTIONS = ["When was the Eiffel Tower in Paris finished?", "What does Big Ben in London do?"]


@pytest.fixture
def llm(engine: KVBoost) -> KVBoostLLM:
    return KVBoostLLM(engine=engine, max_tokens=8)


# -- the LLM ---------------------------------------------------------------------------


def test_metadata_comes_from_the_model(llm: KVBoostLLM, engine: KVBoost) -> None:
    meta = llm.metadata
    assert meta.context_window == engine.context_window == 512
    assert meta.num_output == 8
    assert meta.is_chat_model  # the tokenizer has a chat template
    assert llm.fidelity == engine.config.fidelity
    assert KVBoostLLM(engine=engine, context_window=256).metadata.context_window == 256
    with pytest.raises(ValueError, match="exceeds"):
        KVBoostLLM(engine=engine, context_window=4096)


def test_wrapping_checks_fidelity_and_needs_an_engine(engine: KVBoost) -> None:
    with pytest.raises(ValueError, match="differs from the wrapped engine"):
        KVBoostLLM(engine=engine, fidelity="exact")
    with pytest.raises(ValueError, match="fidelity must be one of"):
        KVBoostLLM(engine=engine, fidelity="turbo")
    with pytest.raises(TypeError, match="from_model_id"):
        KVBoostLLM()


def test_an_unknown_field_is_refused_not_ignored(engine: KVBoost) -> None:
    # LlamaIndex's LLMs drop unknown fields: max_new_tokens=12 used to decode 256 tokens.
    with pytest.raises(ValueError, match="max_new_tokens"):
        KVBoostLLM(engine=engine, max_new_tokens=12)


def test_complete_is_the_engines_answer_with_stats(llm: KVBoostLLM, engine: KVBoost) -> None:
    response = llm.complete("The tower stands in", max_tokens=6)
    expected = engine.generate("The tower stands in", max_new_tokens=6)
    assert response.text == expected.text
    stats = response.additional_kwargs
    assert stats["completion_tokens"] == len(expected.token_ids)
    assert stats["prompt_tokens"] == expected.prompt_tokens
    assert stats["ttft_ms"] > 0 and llm.last_stats == stats


def test_stream_deltas_add_up_to_the_text(llm: KVBoostLLM) -> None:
    chunks = list(llm.stream_complete("The tower stands in"))
    text = ""
    for chunk in chunks:
        text += chunk.delta
        assert chunk.text == text
    assert text == llm.complete("The tower stands in").text
    assert chunks[-1].additional_kwargs["completion_tokens"] == 8


def test_chat_uses_the_chat_template_and_streams(llm: KVBoostLLM, engine: KVBoost) -> None:
    messages = [ChatMessage(role="user", content="Where is the tower?")]
    response = llm.chat(messages)
    assert (
        response.message.content
        == engine.chat([{"role": "user", "content": "Where is the tower?"}], max_new_tokens=8).text
    )
    chunks = list(llm.stream_chat(messages))
    assert "".join(c.delta or "" for c in chunks) == response.message.content
    assert chunks[-1].additional_kwargs["reused_tokens"] > 0  # the template prefix


def test_chat_without_template_goes_through_messages_to_prompt(engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=engine, max_tokens=5, is_chat_model=False)
    messages = [ChatMessage(role="user", content="hi")]
    assert (
        llm.chat(messages).message.content
        == llm.complete(llm.messages_to_prompt(messages), formatted=True).text
    )


def test_sampling_and_stop_options_reach_the_engine(llm: KVBoostLLM) -> None:
    full = llm.complete("abc", max_tokens=12).text
    stop = full[3:5]
    assert llm.complete("abc", max_tokens=12, stop=[stop]).text == full[: full.find(stop)]
    sampled = KVBoostLLM(engine=llm.engine, temperature=1.0, top_k=5, top_p=0.9, seed=3)
    assert sampled.complete("abc", max_tokens=6).text == sampled.complete("abc", max_tokens=6).text
    with pytest.raises(TypeError, match="unknown option"):
        llm.complete("abc", max_new_tokens=3)
    with pytest.raises(ValueError, match="top_p"):
        llm.complete("abc", top_p=0.0)


def test_engine_errors_propagate(llm: KVBoostLLM) -> None:
    with pytest.raises(EmptyPromptError):
        llm.complete("")
    with pytest.raises(ContextWindowError):
        llm.complete("x" * 600)
    with pytest.raises(MarkerError):
        llm.complete(OPEN + "unclosed passage")
    with pytest.raises(MarkerError):
        list(llm.stream_chat([ChatMessage(role="user", content=CLOSE)]))


def test_whitespace_prompts_are_empty_prompts(llm: KVBoostLLM) -> None:
    """complete("   ") answered from 3 tokens of whitespace."""
    for empty in ("   ", "\n\t "):
        with pytest.raises(EmptyPromptError):
            llm.complete(empty)
        with pytest.raises(EmptyPromptError):
            list(llm.stream_complete(empty))
        with pytest.raises(EmptyPromptError):
            llm.chat([ChatMessage(role="user", content=empty)])


def test_a_bad_max_tokens_is_named_as_it_was_passed(llm: KVBoostLLM) -> None:
    """It was reported as the engine's max_new_tokens."""
    with pytest.raises(ValueError, match=r"^max_tokens must be an int >= 1, got 0$"):
        llm.complete("The tower", max_tokens=0)


def test_instrumentation_sees_every_call(llm: KVBoostLLM) -> None:
    seen: list[dict] = []

    class Handler(BaseEventHandler):
        def handle(self, event: object, **kwargs: object) -> None:
            if isinstance(event, (LLMCompletionEndEvent, LLMChatEndEvent)):
                seen.append(event.response.additional_kwargs)  # type: ignore[attr-defined]

    handler = Handler()
    get_dispatcher().add_event_handler(handler)
    try:
        llm.complete("abc")
        list(llm.stream_complete("abc"))
        llm.chat([ChatMessage(role="user", content="abc")])
        asyncio.run(llm.acomplete("abc"))
    finally:
        get_dispatcher().event_handlers.remove(handler)
    assert len(seen) == 4 and all(s["completion_tokens"] > 0 for s in seen)


async def test_async_endpoints_do_not_block_the_loop(llm: KVBoostLLM) -> None:
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = ticks
    response = await llm.acomplete("The tower stands in", max_tokens=64)
    done.set()
    await task
    assert ticks - start >= 3, "the event loop stalled while acomplete ran"
    assert response.text == llm.complete("The tower stands in", max_tokens=64).text

    text = ""
    async for chunk in await llm.astream_complete("The tower stands in"):
        text += chunk.delta or ""
        assert chunk.text == text
    assert text == llm.complete("The tower stands in").text

    messages = [ChatMessage(role="user", content="Where?")]
    answer = (await llm.achat(messages)).message.content
    streamed = "".join([c.delta or "" async for c in await llm.astream_chat(messages)])
    assert streamed == answer == llm.chat(messages).message.content


# -- the node parser --------------------------------------------------------------------


def test_node_parser_cuts_whole_sentences_that_each_fit(engine: KVBoost, tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = " ".join(TEXTS * 4)
    parser = KVBoostNodeParser.from_engine(engine, max_passage_tokens=80)
    pieces = parser.split_text(text)
    assert len(pieces) > 1 and "".join(pieces) == text
    for piece in pieces:
        assert piece.rstrip().endswith((".", "!", "?"))
        ids = tokenizer(piece.strip(), add_special_tokens=False)["input_ids"]
        assert len(ids) <= 80
    assert KVBoostNodeParser.from_engine(engine).max_passage_tokens == 512


def test_node_parser_keeps_max_passage_tokens_without_sentence_ends(engine: KVBoost) -> None:
    """The README says every node fits max_passage_tokens: one without sentence ends was a
    single 2,001-token node."""
    parser = KVBoostNodeParser.from_engine(engine, max_passage_tokens=40)
    for text in ["word " * 2000, "z" * 3000]:
        nodes = parser.get_nodes_from_documents([Document(text=text)])
        sizes = [len(engine.tokenizer(n.get_content())["input_ids"]) for n in nodes]
        assert len(nodes) > 50 and max(sizes) <= 40
        assert "".join(parser.split_text(text)) == text


def test_node_parser_in_an_ingestion_pipeline(engine: KVBoost) -> None:
    parser = KVBoostNodeParser.from_engine(engine, max_passage_tokens=80)
    docs = [Document(text=" ".join(TEXTS * 3), metadata={"source": "towers"})]
    nodes = IngestionPipeline(transformations=[parser]).run(documents=docs)
    assert [n.get_content() for n in nodes] == parser.split_text(docs[0].text)
    assert all(n.metadata == {"source": "towers"} for n in nodes)
    assert nodes[0].ref_doc_id == docs[0].doc_id
    with pytest.raises(TypeError, match="from_engine"):
        KVBoostNodeParser(tokenizer="not a tokenizer")


def test_odd_values_fuzzing_found(llm: KVBoostLLM, engine: KVBoost) -> None:
    with pytest.raises(ValueError, match="stop must be a str"):
        llm.complete("q", stop=5)  # was "'int' object is not iterable" in _common
    with pytest.raises(ValueError, match="top_k must be an int"):
        list(llm.stream_complete("q", top_k=True, temperature=0.5))  # torch.topk's TypeError
    with pytest.raises(ValueError):  # pydantic's ValidationError: True was read as 1
        KVBoostLLM(engine=engine, max_tokens=True)
