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

LOOP_STEPS = 8  # model calls before a loop counts as stuck (LangChain's route: recursion 8)


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
            {"role": "user", "content": task.prompt},
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
    state: dict[str, Any] = {"messages": [HumanMessage(task.prompt)]}
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
    return _llamaindex(engine, task, max_tokens, react=False)


def react_route(engine: KVBoost, task: ToolTask, max_tokens: int) -> Outcome:
    """LlamaIndex's ``ReActAgent``: calls written as text (Thought / Action / Action Input)
    in plain chat, no tools offered to the engine."""
    return _llamaindex(engine, task, max_tokens, react=True)


def _llamaindex(engine: KVBoost, task: ToolTask, max_tokens: int, react: bool) -> Outcome:
    from llama_index.core.agent.workflow import (
        AgentInput,
        FunctionAgent,
        ReActAgent,
        ToolCallResult,
    )
    from workflows.errors import WorkflowRuntimeError

    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    llm = KVBoostLLM(engine=engine, max_tokens=max_tokens)
    kind = ReActAgent if react else FunctionAgent
    agent = kind(tools=list(FUNCTIONS), llm=llm, system_prompt=SYSTEM)
    steps, tools = 0, []

    async def run() -> str | None:
        nonlocal steps
        handler = agent.run(task.prompt, max_iterations=6)
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


def generate_route(engine: KVBoost, task: ToolTask, max_tokens: int) -> Outcome:
    """The same loop with the model alone (``benchmarks/common/plain.py``): its template,
    ``generate`` and a plain parser; calls and results in the template's own message form."""
    from benchmarks.common.plain import plain_answer

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.prompt},
    ]
    tools_run: list[str] = []
    for step in range(1, LOOP_STEPS + 1):
        text, calls = plain_answer(engine, messages, SPECS, max_tokens)
        if not calls:
            return Outcome(task.right_answer(text), tools_run, 0, text, step)
        made = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
        messages.append({"role": "assistant", "content": text, "tool_calls": made})
        for name, arguments in calls:
            tools_run.append(name)
            messages.append({"role": "tool", "content": run_tool(name, arguments)})
    return Outcome(False, tools_run, 0, "", LOOP_STEPS, limited=True)


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    """A call's result as a client sends it back: its error too (a wrong call)."""
    functions = {f.__name__: f for f in FUNCTIONS}
    try:
        return str(functions[name](**arguments))
    except Exception as error:
        return f"error: {error}"


ROUTES: dict[str, Callable[[KVBoost, ToolTask, int], Outcome]] = {
    "engine forced": engine_route("required"),
    "engine auto": engine_route("auto"),
    "langchain agent": langchain_route,
    "llamaindex agent": llamaindex_route,
    "openai loop": openai_route,
    "llamaindex react": react_route,
    "generate loop": generate_route,
}
