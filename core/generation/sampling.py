"""Sampling options: validated once, translated to a transformers ``GenerationConfig``."""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from transformers import GenerationConfig

# A temperature this small divides logits past float32's range (NaN probabilities inside
# transformers) and samples the argmax anyway, so it decodes greedily (vLLM's threshold).
GREEDY_BELOW = 1e-5
MAX_SEED = 2**64 - 1  # torch.manual_seed takes [0, 2**64); -1 is not "random" here


@dataclass(frozen=True)
class SamplingOptions:
    """What a caller may ask of decoding. Raises ``ValueError`` for a value of the wrong
    type (bools are not numbers here) or out of range; numpy scalars are taken."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 (anything below GREEDY_BELOW) decodes greedily; top_p /
    # top_k only apply when sampling
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop: tuple[str, ...] = ()  # stop strings of any length; the text ends before them
    seed: int | None = None  # makes sampling reproducible
    # Prompt-lookup speculation: at most this many drafted tokens verified per step (0: off;
    # None: the engine's ``KVBoostConfig.draft_tokens``). Outputs are the same either way.
    draft_tokens: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen; numpy scalars are stored as Python numbers
        set_(self, "max_new_tokens", _integer("max_new_tokens", self.max_new_tokens, 1))
        set_(self, "temperature", _real("temperature", self.temperature, ">= 0 (0 = greedy)"))
        set_(self, "top_p", _real("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1))
        set_(self, "top_k", _integer("top_k", self.top_k, 0, hint="an int >= 0 (0 disables it)"))
        _check_stops(self.stop)
        if self.seed is not None:
            hint = "an int in [0, 2**64 - 1] or None"
            set_(self, "seed", _integer("seed", self.seed, 0, MAX_SEED, hint))
        if self.draft_tokens is not None:
            hint = "an int in [0, 64] (0 turns speculation off) or None"
            set_(self, "draft_tokens", _integer("draft_tokens", self.draft_tokens, 0, 64, hint))

    @classmethod
    def build(cls, stop: object = None, **kwargs: object) -> SamplingOptions:
        """Accepts ``stop`` as one string, a list or tuple of strings, or None."""
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, (list, tuple)):
            stops = tuple(stop)
        else:
            raise ValueError(
                f"stop must be a str, a list of str or None, got {type(stop).__name__}"
            )
        return cls(stop=stops, **kwargs)  # type: ignore[arg-type]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

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


def _integer(name: str, value: object, low: int, high: int | None = None, hint: str = "") -> int:
    """``value`` as an int in [low, high]; bools and floats are refused, not rounded."""
    message = f"{name} must be {hint or f'an int >= {low}'}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(message)
    number = int(value)
    if number < low or (high is not None and number > high):
        raise ValueError(message)
    return number


def _real(
    name: str, value: object, hint: str, within: Callable[[float], bool] = lambda x: x >= 0
) -> float:
    """``value`` as a finite float: inf and NaN reach transformers' warpers as NaN
    probabilities."""
    message = f"{name} must be {hint}, a finite number; got {value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(message)
    number = float(value)
    if not math.isfinite(number) or not within(number):
        raise ValueError(message)
    return number


def _check_stops(stops: object) -> None:
    if not isinstance(stops, tuple) or any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop must be non-empty strings, got {stops!r}")
    for stop in stops:
        try:
            stop.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"stop string {stop!r} holds a lone surrogate: pass valid Unicode"
            ) from None
