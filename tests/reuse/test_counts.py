"""``passages_hit`` counts the passages whose stored KV an answer used, on every route the
policy takes and on every surface that reports it: the engine's result, LangChain's
``generation_info``, LlamaIndex's ``additional_kwargs`` and the server's ``usage.kvboost``.
A passage the cache held but the answer did not use (the prompt prefilled plainly, or all
of it recomputed by the repair) is ``passages_unused``; one it did not hold, ``missed``.
Before, a passage the index found counted as a hit even when the policy then prefilled the
prompt plainly: "hit 3" beside 87 of 315 tokens reused (issue 62)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.prompt.chunker import passage

# One token a character: these are 70-90 tokens each, over the policy's 64-token floor.
LONG = [
    "The Loire is the longest river in France and flows west for one thousand kilometres.",
    "Mont Blanc is the highest mountain of the Alps, at four thousand eight hundred metres.",
    "The Seine flows through Paris and reaches the English Channel at the port of Le Havre.",
    "Lyon lies where the Rhone meets the Saone, and its old town is a world heritage site.",
]
SHORT = ["Paris is in France.", "Rome is in Italy.", "Oslo is in Norway."]
QUESTION = "\nQuestion: which river is the longest? Answer:"
COUNTS = ("passages_hit", "passages_unused", "passages_missed")


def prompt(texts: list[str]) -> str:
    return "".join(passage(t) + "\n" for t in texts) + QUESTION


# (warmed, sent, config, the route's words, expected hit / unused / missed)
ROUTES: dict[str, tuple[list[str], list[str], dict[str, Any], str, tuple[int, int, int]]] = {
    "reused": (LONG[:3], LONG[:3], {}, "reuse: 3 of 3 passages cached", (3, 0, 0)),
    "reused, one encoded": (LONG[:3], LONG, {}, "reuse: 3 of 4 passages cached", (3, 0, 1)),
    "prefilled: short passages": (SHORT, SHORT, {}, "under 64", (0, 3, 0)),
    "prefilled: most not cached": (LONG[:1], LONG[:3], {}, "not cached", (0, 1, 2)),
    "recomputed whole by the repair": (
        LONG[:2],
        LONG[:2],
        {"recompute_ratio": 1.0},
        "reuse: 2 of 2",
        (0, 2, 0),
    ),
}


def engine(tokenizer: Any, warmed: list[str], config: dict[str, Any]) -> KVBoost:
    """A fresh engine (caches of its own) with ``warmed`` in its passage cache."""
    built = KVBoost(
        make_model("llama"),
        tokenizer,
        KVBoostConfig(
            block_tokens=8,
            fidelity="balanced",
            **{"repair": "deviation", "recompute_ratio": 0.15, **config},
        ),
    )
    assert built.warm_passages(warmed).units == len(warmed)
    return built


def through_engine(built: KVBoost, text: str) -> dict[str, Any]:
    result = built.generate(text, max_new_tokens=2)
    return {name: getattr(result, name) for name in (*COUNTS, "reuse_reason")}


def through_langchain(built: KVBoost, text: str) -> dict[str, Any]:
    from kvboost_rag.integrations.langchain import KVBoostPipeline

    llm = KVBoostPipeline(engine=built, max_tokens=2)
    info = llm.generate([text]).generations[0][0].generation_info
    assert info is not None
    return info


def through_llamaindex(built: KVBoost, text: str) -> dict[str, Any]:
    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    return dict(KVBoostLLM(engine=built, max_tokens=2).complete(text).additional_kwargs)


def through_server(built: KVBoost, text: str) -> dict[str, Any]:
    from kvboost_rag.serve import ServeSettings, serving

    with serving(built, ServeSettings(model_name="tiny", port=0)) as url:
        body = {"model": "tiny", "prompt": text, "max_tokens": 2}
        reply = httpx.post(f"{url}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["usage"]["kvboost"])


SURFACES: dict[str, Callable[[KVBoost, str], dict[str, Any]]] = {
    "engine": through_engine,
    "langchain": through_langchain,
    "llamaindex": through_llamaindex,
    "server": through_server,
}


@pytest.mark.short_passages  # the engine's rule for short passages, as users get it
@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("route", list(ROUTES))
def test_passages_hit_counts_the_passages_whose_kv_was_used(
    tokenizer: Any, route: str, surface: str
) -> None:
    warmed, sent, config, said, expected = ROUTES[route]
    stats = SURFACES[surface](engine(tokenizer, warmed, config), prompt(sent))
    assert tuple(stats[name] for name in COUNTS) == expected, stats
    assert said in stats["reuse_reason"], stats["reuse_reason"]
