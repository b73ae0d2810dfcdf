"""Engine configuration: one frozen, validated object passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Fidelity = Literal["exact", "balanced", "fast"]
FIDELITY_LEVELS: tuple[str, ...] = ("exact", "balanced", "fast")


@dataclass(frozen=True)
class KVBoostConfig:
    """How the engine caches and reuses KV.

    Raises ``ValueError`` on construction when a field is out of range.
    """

    # "exact": prefix cache only, output identical to full prefill.
    # "balanced" / "fast": passage reuse at any position (more repair / less repair).
    fidelity: Fidelity = "exact"
    # Byte budget of the in-memory KV store; least recently used entries go first.
    max_cache_bytes: int = 2 * 1024**3
    # Tokens per prefix-cache block; only full blocks are cached (vLLM semantics).
    block_tokens: int = 16
    # Store the prompt and the generated answer as reusable prefix after each request,
    # so a multi-turn conversation reuses its history.
    cache_generated: bool = True

    def __post_init__(self) -> None:
        if self.fidelity not in FIDELITY_LEVELS:
            raise ValueError(f"fidelity must be one of {FIDELITY_LEVELS}, got {self.fidelity!r}")
        if self.max_cache_bytes < 0:
            raise ValueError(f"max_cache_bytes must be >= 0, got {self.max_cache_bytes}")
        if not 1 <= self.block_tokens <= 4096:
            raise ValueError(f"block_tokens must be in [1, 4096], got {self.block_tokens}")
