"""kvboost-rag: compute each passage's attention KV once, reuse it in every later prompt."""

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.errors import (
    ContextWindowError,
    EmptyPromptError,
    KVBoostError,
    UnknownModelError,
)
from kvboost_rag.core.generation.streaming import GenerationStream
from kvboost_rag.core.prompt.chunker import MarkerError, format_passages, passage
from kvboost_rag.core.prompt.prompts import ChatTemplateError
from kvboost_rag.core.results import (
    EngineStats,
    GenerationResult,
    Timings,
    WarmResult,
)
from kvboost_rag.warm import warm_corpus

__all__ = [
    "ChatTemplateError",
    "ContextWindowError",
    "EmptyPromptError",
    "EngineStats",
    "GenerationResult",
    "GenerationStream",
    "KVBoost",
    "KVBoostConfig",
    "KVBoostError",
    "MarkerError",
    "Timings",
    "UnknownModelError",
    "WarmResult",
    "format_passages",
    "passage",
    "warm_corpus",
]
__version__ = "0.1.0"
