"""kvboost-rag: compute each passage's attention KV once, reuse it in every later prompt."""

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.engine import EngineStats, KVBoost, WarmResult
from kvboost_rag.core.errors import (
    ContextWindowError,
    EmptyPromptError,
    KVBoostError,
    UnknownModelError,
)
from kvboost_rag.core.result import GenerationResult, Timings
from kvboost_rag.core.streaming import GenerationStream

__all__ = [
    "ContextWindowError",
    "EmptyPromptError",
    "EngineStats",
    "GenerationResult",
    "GenerationStream",
    "KVBoost",
    "KVBoostConfig",
    "KVBoostError",
    "Timings",
    "UnknownModelError",
    "WarmResult",
]
__version__ = "0.1.0"
