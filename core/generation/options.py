"""A request's keyword options, declared once: ``generate`` / ``stream`` take
``TextOptions``, ``chat`` / ``stream_chat`` take ``ChatOptions`` (type checkers see each
keyword through ``Unpack``), and anything else is a ``TypeError`` naming what they take."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from typing_extensions import TypedDict

from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.tools.formats import Tool
from kvboost_rag.core.tools.structure import ResponseFormat


class Sampling(TypedDict, total=False):
    """``SamplingOptions``' fields, where they are documented."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: str | Sequence[str] | None
    seed: int | None
    draft_tokens: int | None


class TextOptions(Sampling, total=False):
    """``generate`` / ``stream``: passages placed before the prompt, and the answer's form."""

    passages: Sequence[str] | None
    response_format: ResponseFormat | None
    constrain: bool | None


class ChatOptions(Sampling, total=False):
    """``chat`` / ``stream_chat``: tools offered to the model, and the answer's form."""

    tools: Sequence[Tool] | None
    tool_choice: str
    parallel_tool_calls: bool
    response_format: ResponseFormat | None
    constrain: bool | None
    repeat_guard: bool


SAMPLING_OPTIONS = tuple(f.name for f in dataclasses.fields(SamplingOptions))
assert set(SAMPLING_OPTIONS) == set(Sampling.__annotations__), "Sampling lags SamplingOptions"
# What the framework adapters call an option, and the engine's name for it.
ADAPTER_NAMES = {"max_tokens": "max_new_tokens"}


def split_options(
    options: dict[str, Any], taken: type[TextOptions] | type[ChatOptions]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` as (sampling options, the rest); ``TypeError`` for one ``taken`` lacks."""
    names = list(taken.__annotations__)
    unknown = sorted(set(options) - set(names))
    if unknown:
        hints = [f"{k}= is {ADAPTER_NAMES[k]}= here" for k in unknown if k in ADAPTER_NAMES]
        raise TypeError(
            f"unknown option(s) {unknown}; a request takes {names}"
            + "".join(f" ({hint})" for hint in hints)
        )
    sampling = {k: v for k, v in options.items() if k in SAMPLING_OPTIONS}
    return sampling, {k: v for k, v in options.items() if k not in SAMPLING_OPTIONS}
