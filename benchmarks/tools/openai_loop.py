"""The tool benchmark's plain ``openai``-client route: the server's app (``kvboost-rag
serve``'s, over the benchmark's engine) on a local port, and the loop every client writes:
ask, run the tools the answer calls, send their results, until the answer is text."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from benchmarks.common.cluster_server import free_ports
from benchmarks.tools.tasks import SPECS, SYSTEM, ToolTask
from kvboost_rag.core.engine import KVBoost

_SERVERS: dict[int, str] = {}  # engine id -> base URL of its running server


def _base_url(engine: KVBoost) -> str:
    """A server over ``engine`` on a free loopback port, started once per engine."""
    if id(engine) in _SERVERS:
        return _SERVERS[id(engine)]
    import uvicorn

    from kvboost_rag.serve.app import create_app
    from kvboost_rag.serve.settings import ServeSettings

    (port,) = free_ports(1)
    app = create_app(engine, ServeSettings(model_name="bench", port=port))
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the benchmark's server did not start in 60 s")
        time.sleep(0.05)
    _SERVERS[id(engine)] = url = f"http://127.0.0.1:{port}/v1"
    return url


def openai_route(engine: KVBoost, task: ToolTask, max_tokens: int) -> Any:
    from openai import OpenAI

    from benchmarks.tools.routes import LOOP_STEPS, Outcome, run_tool

    client = OpenAI(base_url=_base_url(engine), api_key="unused")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.prompt},
    ]
    tools_run: list[str] = []
    for step in range(1, LOOP_STEPS + 1):
        # plain dicts, as a client's loop builds them (the SDK's TypedDicts are not needed)
        wire: Any = {"messages": messages, "tools": SPECS}
        reply = client.chat.completions.create(model="bench", max_tokens=max_tokens, **wire)
        message = reply.choices[0].message
        if not message.tool_calls:
            final = message.content or ""
            return Outcome(task.right_answer(final), tools_run, 0, final, step)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            name = call.function.name  # type: ignore[union-attr]
            tools_run.append(name)
            output = run_tool(name, json.loads(call.function.arguments))  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return Outcome(False, tools_run, 0, "", LOOP_STEPS, limited=True)
