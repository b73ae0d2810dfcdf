"""The routes a tool call takes, each answering one task: the engine's ``chat`` with the call
forced or left to the model (right when the call is), LangChain's ``create_agent`` on
``ChatKVBoost``, LlamaIndex's ``FunctionAgent`` on ``KVBoostLLM`` and a plain ``openai``
client looping against the server (right when the final answer is, after the tools the
agent ran)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.tools.tasks import FUNCTIONS, SPECS, SYSTEM, ToolTask
from kvboost_rag.core.engine import KVBoost


@dataclass
class Outcome:
    """One task through one route."""

    right: bool  # the call (engine routes) or the final answer (agents) is right
    tools_run: list[str] = field(default_factory=list)  # calls made, by tool name
    invalid: int = 0  # calls that could not be read
    final: str = ""  # the answer's text (engine routes: the calls as text)
    steps: int = 1  # model calls
    limited: bool = False  # the agent loop ran into its limit (the model kept calling)


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
    from langgraph.errors import GraphRecursionError

    from kvboost_rag.integrations.langchain import ChatKVBoost

    chat = ChatKVBoost(engine=engine, max_tokens=max_tokens)
    agent: Any = create_agent(chat, [tool(f) for f in FUNCTIONS], system_prompt=SYSTEM)
    state: dict[str, Any] = {"messages": [HumanMessage(task.question)]}
    limited = False
    try:  # the last state stays when the loop runs into its limit
        for step in agent.stream(state, {"recursion_limit": 8}, stream_mode="values"):
            state = step
    except GraphRecursionError:
        limited = True
    messages = state["messages"]
    answers = [m for m in messages if isinstance(m, AIMessage)]
    final = "" if limited or not answers else str(answers[-1].content)
    return Outcome(
        right=task.right_answer(final),
        tools_run=[str(m.name) for m in messages if isinstance(m, ToolMessage)],
        invalid=sum(len(m.invalid_tool_calls) for m in answers),
        final=final,
        steps=len(answers),
        limited=limited,
    )


def llamaindex_route(engine: KVBoost, task: ToolTask, max_tokens: int) -> Outcome:
    from llama_index.core.agent.workflow import AgentInput, FunctionAgent, ToolCallResult
    from workflows.errors import WorkflowRuntimeError

    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    llm = KVBoostLLM(engine=engine, max_tokens=max_tokens)
    agent = FunctionAgent(tools=list(FUNCTIONS), llm=llm, system_prompt=SYSTEM)
    steps, tools = 0, []

    async def run() -> str | None:
        nonlocal steps
        handler = agent.run(task.question, max_iterations=4)
        async for event in handler.stream_events():
            steps += isinstance(event, AgentInput)
            if isinstance(event, ToolCallResult):
                tools.append(event.tool_name)
        try:
            result: Any = await handler
            return str(result.response.content or "")
        except WorkflowRuntimeError as error:  # the loop ran into its limit
            if "Max iterations" not in str(error):
                raise
            return None

    final = asyncio.run(run())
    return Outcome(
        right=final is not None and task.right_answer(final),
        tools_run=tools,
        final=final or "",
        steps=steps,
        limited=final is None,
    )


def openai_route(engine: KVBoost, task: ToolTask, max_tokens: int) -> Outcome:
    from benchmarks.tools.openai_loop import openai_route as loop

    return loop(engine, task, max_tokens)  # type: ignore[no-any-return]


ROUTES: dict[str, Callable[[KVBoost, ToolTask, int], Outcome]] = {
    "engine forced": engine_route("required"),
    "engine auto": engine_route("auto"),
    "langchain agent": langchain_route,
    "llamaindex agent": llamaindex_route,
    "openai loop": openai_route,
}
