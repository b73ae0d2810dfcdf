"""Sampling options: validated once, translated to a transformers ``GenerationConfig``."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from transformers import GenerationConfig


@dataclass(frozen=True)
class SamplingOptions:
    """What a caller may ask of decoding. Raises ``ValueError`` for out-of-range values."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy; top_p / top_k only apply when sampling
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop: tuple[str, ...] = ()  # stop strings of any length; the text ends before them
    seed: int | None = None  # makes sampling reproducible

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @classmethod
    def build(
        cls, stop: str | list[str] | tuple[str, ...] | None = None, **kwargs: object
    ) -> SamplingOptions:
        """Accepts ``stop`` as one string, a list, or None."""
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        else:
            stops = tuple(stop)
        return cls(stop=stops, **kwargs)  # type: ignore[arg-type]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generation_config(self, base: GenerationConfig, max_new_tokens: int) -> GenerationConfig:
        """A copy of the model's generation config with these options applied."""
        config = copy.deepcopy(base)
        config.max_new_tokens = max_new_tokens
        config.max_length = None
        config.do_sample = not self.greedy
        config.num_beams = 1
        # Unset sampling knobs when greedy so transformers does not warn they are unused.
        config.temperature = None if self.greedy else self.temperature
        config.top_p = None if self.greedy else self.top_p
        config.top_k = None if self.greedy else self.top_k
        config.stop_strings = list(self.stop) or None
        config.return_dict_in_generate = False
        return config
