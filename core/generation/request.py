"""One request as it flows through the engine: every stage fills in its part.

The caller's thread validates and tokenizes it and looks up what the caches hold
(``lookup``, ``plan``); the executor builds its context in a KV row (``context``), feeds
the positions left to compute (``fill``), picks its tokens (``sampler``) and ends it
(``result``). The owner (the engine that made it) says how its context is built and what
is stored after it: the executor serves engines with different caches on one model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from kvboost_rag.core.generation.sampler import Sampler
from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.generation.speculation import PromptLookup
from kvboost_rag.core.prompt.chunker import TokenizedPrompt
from kvboost_rag.core.results import GenerationResult, Timings
from kvboost_rag.core.reuse.assemble import RowKV
from kvboost_rag.core.reuse.context import Context
from kvboost_rag.core.reuse.lookup import Lookup
from kvboost_rag.core.reuse.plan import Plan
from kvboost_rag.core.tools.structure import Structure


class Status(Enum):
    WAITING = "waiting"  # looked up, queued for the executor
    BUILDING = "building"  # has a row; its context is being computed
    RUNNING = "running"  # decoding
    FINISHED = "finished"


class Owner(Protocol):
    """What the executor asks of the engine that made a request (on the executor thread)."""

    def build(self, request: Request, row: RowKV) -> Context:
        """Write the request's reused KV into ``row``; the positions left to compute."""

    def result(self, request: Request) -> GenerationResult:
        """What the caller gets, once the request has ended."""

    def finished(self, request: Request, row: RowKV) -> None:
        """After ``result``, before the row is freed: copy what is worth storing out of
        ``row`` and queue its stores (never wait on storage here)."""


@dataclass(eq=False)
class Request:
    prompt: TokenizedPrompt
    sampling: SamplingOptions
    owner: Owner
    sampler: Sampler
    structure: Structure  # the answer's form: tool calls are parsed out of the text
    limit: int  # the most requests its engine lets run in one batch
    kv_budget: int  # the most bytes of KV its engine lets the batch's rows hold
    packed: bool | None  # its engine's ``packed_head``
    compiled: bool  # its engine's ``compiled_step`` is not "off"
    start: float  # perf_counter at the call
    timings: Timings
    lookup: Lookup
    plan: Plan
    on_token: Callable[[int], None] | None = None  # each chosen token (executor thread)
    on_end: Callable[[Request], None] | None = None  # once ended, before ``done`` is set
    cancel: threading.Event = field(default_factory=threading.Event)
    # Logits-only requests (fidelity checks): tokens fed after the prompt, no decoding;
    # ``logits`` then holds the next-token logits after the prompt and after each of them.
    feed: list[int] | None = None
    drafter: PromptLookup | None = None  # speculation's draft source; None: no drafting
    drafted: int = 0  # draft tokens proposed so far
    accepted: int = 0  # ... and kept
    status: Status = Status.WAITING
    submitted_at: float = 0.0  # perf_counter readings: handed to the executor,
    filled_at: float = 0.0  # ... its context built (its fill forwards start)
    context: Context | None = None
    fill: list[int] = field(default_factory=list)  # positions still to compute
    tokens: list[int] = field(default_factory=list)  # the prompt, then every chosen token
    first_at: float | None = None
    ended_at: float | None = None
    logits: torch.Tensor | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt.tokens) :]

    def emit(self, token: int) -> None:
        """Append a chosen token and hand it to the stream (on the executor thread)."""
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.tokens.append(token)
        if self.on_token is not None:
            self.on_token(token)

    def wait(self) -> GenerationResult:
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result
