"""The configuration's choices as plain values: the names of each choice (each registry
that implements them, in reuse/repair.py, store/codec.py and tools/formats.py, asserts it
holds exactly these, so configuration depends on none of them) and the repair settings
each fidelity level runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

REPAIR_STRATEGIES = ("none", "edges", "deviation", "shared", "query", "passage")
KV_CODECS = ("none", "int8", "fp8")
TOOL_FORMATS = ("hermes", "json", "llama3")


@dataclass(frozen=True)
class RepairSettings:
    strategy: str  # one of REPAIR_STRATEGIES
    edge_tokens: int  # "edges": first tokens of each reused passage
    recompute_ratio: float  # "deviation": share of reused tokens recomputed
    probe_layers: int | None  # "deviation" / "query": decoder layers run to choose tokens
    # (None: deviation 2, query all; capped at the model's depth)
    # "query": stop choosing once the chosen tokens hold this share of the attention the
    # question pays to the reused ones (an adaptive ratio, at most ``recompute_ratio``);
    # None: always ``recompute_ratio``.
    recompute_mass: float | None = None


# "exact": prefix cache only, bit-faithful; "balanced": passage reuse with the "shared"
# repair; "fast": passage reuse without repair (FIDELITY_REPAIR). The one list of levels.
Fidelity = Literal["exact", "balanced", "fast"]
FIDELITY_LEVELS: tuple[str, ...] = get_args(Fidelity)

# What passages are encoded after. "prompt": the prompt's own prefix (everything before its
# first passage), so the KV is what a full prefill computes for the first passage and close
# to it for the others; the cache key folds the prefix in. "anchor": BOS only, one variant
# per passage for every prompt (lower accuracy, measured in docs/bench/front-*.txt).
PassagePrefix = Literal["prompt", "anchor"]
# When a prompt's prefix has no variant of a passage. "nearest": reuse the variant of the
# known prefix sharing the most leading tokens (reported per request as passages_foreign);
# "encode": treat it as a miss (encoded now under the real prefix, or the prompt is
# prefilled plainly and its passages encoded after the answer).
PrefixFallback = Literal["nearest", "encode"]
# Whether a one-request decoding step runs compiled: ``KVBoostConfig.compiled_step``.
CompiledStepChoice = Literal["off", "measured", "on"]


def check_fidelity(value: str) -> Fidelity:
    """``value`` if it names a fidelity level; else ``ValueError`` listing them."""
    if value not in FIDELITY_LEVELS:
        raise ValueError(f"fidelity must be one of {FIDELITY_LEVELS}, got {value!r}")
    return value  # type: ignore[return-value]


# Defaults per fidelity level, chosen by measurement on real models (issue 46,
# docs/bench/front-real-*.txt: Qwen2.5-Coder 0.5B / 1.5B, ~1k-token prompts of 4 warmed
# passages, chat and completion prompts, the answer's passage at every position, whole
# answers scored). "balanced": the shared repair (every sentence of a passage holding text
# another passage holds, and each passage's first 4 tokens; past 40% of the reused tokens,
# all of them), which on the 0.5B kept 41 of full prefill's 42 right answers where the
# deviation repair that was the default (the 25% of reused tokens whose layer-1 values
# moved most) kept 37 at half its speed, and no repair 35: on look-alike passages (a fact
# sentence of one shape in each) the tokens whose KV moves most under reuse are those
# sentences and the passages' first words, which the shared repair finds from token ids with
# no probe. "fast" repairs nothing: as good on passages unlike each other, and the fastest.
FIDELITY_REPAIR: dict[str, RepairSettings] = {
    "balanced": RepairSettings("shared", edge_tokens=4, recompute_ratio=0.40, probe_layers=None),
    "fast": RepairSettings("none", edge_tokens=4, recompute_ratio=0.15, probe_layers=None),
}
