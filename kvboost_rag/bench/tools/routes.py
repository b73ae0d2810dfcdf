"""The routes a tool call takes, each answering one task: the engine's ``chat`` with the call
forced or left to the model (right when the call is), LangChain's ``create_agent`` on
``ChatKVBoost`` and LlamaIndex's ``FunctionAgent`` on ``KVBoostLLM`` (right when the final
answer is, after the tools the agent ran)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvboost_rag.bench.tools.tasks import FUNCTIONS, SPECS, SYSTEM, ToolTask
from kvboost_rag.core.engine import KVBoost


@dataclass
class Outcome:
    """One task through one route."""

    right: bool  # the call (engine routes) or the final answer (agents) is right
    tools_run: list[str] = field(default_factory=list)  # calls made, by tool name
    invalid: int = 0  # calls that could not be read
    final: str = ""  # the answer's text (engine routes: the calls as text)
    steps: int = 1  # model calls


def engine_route(choice: str) -> Callable[[KVBoost, ToolTask, int], Outcome]:
    def route(engine: KVBoost, task: ToolTask, max_tokens: int) -> Outcome:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task.question},
        ]
        result = engine.chat(messages, tools=SPECS, tool_choice=choice, max_new_tokens=max_tokens)
        calls = [(c.name, c.arguments) for c in result.tool_calls]
        return Outcome(
            right=len(calls) == 1 and task.right_call(*calls[0]),
            tools_run=[name for name, _ in calls],
            invalid=len(result.invalid_tool_calls),
            final=result.text or repr(calls or result.invalid_tool_calls),
        )

    return route


def langchain_route(engine: KVBoost, task: ToolTask, max_tokens: int) -> Outcome:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    from kvboost_rag.integrations.langchain import ChatKVBoost

    chat = ChatKVBoost(engine=engine, max_tokens=max_tokens)
    agent = create_agent(chat, [tool(f) for f in FUNCTIONS], system_prompt=SYSTEM)
    out = agent.invoke({"messages": [HumanMessage(task.question)]}, {"recursion_limit": 8})
    messages = out["messages"]
    answers = [m for m in messages if isinstance(m, AIMessage)]
    final = str(answers[-1].content) if answers else ""
    return Outcome(
        right=task.right_answer(final),
        tools_run=[str(m.name) for m in messages if isinstance(m, ToolMessage)],
        invalid=sum(len(m.invalid_tool_calls) for m in answers),
        final=final,
        steps=len(answers),
    )


def llamaindex_route(engine: KVBoost, task: ToolTask, max_tokens: int) -> Outcome:
    from llama_index.core.agent.workflow import FunctionAgent

    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    llm = KVBoostLLM(engine=engine, max_tokens=max_tokens)
    agent = FunctionAgent(tools=list(FUNCTIONS), llm=llm, system_prompt=SYSTEM)
    steps = []

    async def run() -> Any:
        handler = agent.run(task.question, max_iterations=4)
        async for event in handler.stream_events():
            if type(event).__name__ == "AgentInput":
                steps.append(event)
        return await handler

    result = asyncio.run(run())
    final = str(result.response.content or "")
    return Outcome(
        right=task.right_answer(final),
        tools_run=[call.tool_name for call in result.tool_calls],
        final=final,
        steps=len(steps),
    )


ROUTES: dict[str, Callable[[KVBoost, ToolTask, int], Outcome]] = {
    "engine forced": engine_route("required"),
    "engine auto": engine_route("auto"),
    "langchain agent": langchain_route,
    "llamaindex agent": llamaindex_route,
}
