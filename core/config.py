"""Engine configuration: one frozen, validated object passed down explicitly."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar, get_args

import torch

from kvboost_rag.core.choices import (
    FIDELITY_LEVELS,
    FIDELITY_REPAIR,
    KV_CODECS,
    REPAIR_STRATEGIES,
    TOOL_FORMATS,
    CompiledStepChoice,
    Fidelity,
    PassagePrefix,
    PrefixFallback,
    RepairSettings,
    check_fidelity,
)
from kvboost_rag.core.field_types import check_field_types
from kvboost_rag.core.remote_url import check_url

__all__ = ["FIDELITY_LEVELS", "Fidelity", "KVBoostConfig", "check_fidelity"]

T = TypeVar("T")
SECRET_ENV = "KVBOOST_CACHE_SECRET"


# Settings for experts: tuned defaults, each measured on the models DESIGN.md names (the
# records in docs/bench). Leave them unless a measurement on your model says otherwise;
# the configuration guide lists them apart from the everyday ones.
EXPERT_FIELDS = frozenset(
    "block_tokens repair recompute_ratio recompute_mass edge_tokens probe_layers passage_prefix "
    "prefix_fallback passage_anchor encode_batch_tokens draft_tokens packed_head packed_linears "
    "compiled_step remember_measurements".split()
)


@dataclass(frozen=True)
class KVBoostConfig:
    """How the engine caches and reuses KV.

    Raises ``ValueError`` on construction when a field is out of range.
    """

    # "exact": prefix cache only, output identical to full prefill. "balanced": passage
    # reuse at any position with the "shared" repair; "fast": passage reuse without repair
    # (FIDELITY_REPAIR below; what each keeps: the README's and the fidelity guide's table).
    fidelity: Fidelity = "balanced"
    # Byte budget of the in-memory KV store; least recently used entries go first.
    max_cache_bytes: int = 2 * 1024**3
    # Tokens per prefix-cache block; only full blocks are cached (vLLM semantics).
    block_tokens: int = 16
    # Store the prompt and the generated answer as reusable prefix after each request,
    # so a multi-turn conversation reuses its history.
    cache_generated: bool = True
    # Repair strategy for reused passages; None takes the fidelity level's default
    # (see FIDELITY_REPAIR). One of REPAIR_STRATEGIES: "none",
    # "edges", "deviation", "shared", "query", "passage".
    repair: str | None = None
    # Share of reused passage tokens recomputed by the "deviation", "query" and "passage"
    # strategies; for "shared", the share past which it recomputes every reused token. None
    # takes the fidelity level's default.
    recompute_ratio: float | None = None
    # "query" only: an adaptive ratio. Recompute the fewest top tokens holding this share of
    # the attention the question pays to reused tokens, at most ``recompute_ratio`` of
    # them; None recomputes ``recompute_ratio`` always.
    recompute_mass: float | None = None
    # Leading tokens of each reused passage recomputed by the "edges" and "shared"
    # strategies.
    edge_tokens: int | None = None
    # Decoder layers the "deviation" / "query" strategies probe to choose tokens: deviation
    # compares layer ``probe_layers - 1``'s values (the layers before it run, then only its
    # key and value projections); query sums the question's attention over the first
    # ``probe_layers``. None takes the fidelity level's depth when ``repair`` is the level's
    # own strategy (neither level probes: "shared" and "none" run no model to choose), else
    # the strategy's own (deviation: 2, query: 8).
    probe_layers: int | None = None
    # Passages longer than this split into sentence-aligned pieces, each cached alone.
    max_passage_tokens: int = 512
    # Encode passages after the prompt's own prefix or after BOS only (see PassagePrefix).
    passage_prefix: PassagePrefix = "prompt"
    # A passage whose prompt prefix has no cached variant (see PrefixFallback).
    prefix_fallback: PrefixFallback = "nearest"
    # Encode passages after the tokenizer's BOS (not stored) instead of at position 0, where
    # there is no prompt prefix to encode them after.
    passage_anchor: bool = True
    # Padded tokens per passage-encoding batch (bounds peak memory while warming).
    encode_batch_tokens: int = 8192
    # Folder of the persistent disk tier (shared by processes); None keeps KV in memory only.
    cache_dir: str | Path | None = None
    # Byte budget of the disk tier; least recently used files go first.
    max_disk_bytes: int = 20 * 1024**3
    # The shared tier every machine reads: a Redis / Valkey URL ("redis://host:6379/0",
    # "rediss://" for TLS, "redis://:password@host", "unix:///path.sock"), or a Redis
    # Cluster's seed nodes ("redis-cluster://host:7000,host:7001", LMCache's form: see
    # core/store/redis_client.py); None: no shared tier. Needs the redis extra. Faults
    # never reach requests (see core/store/remote.py).
    remote_url: str | None = None
    # Key prefix in the shared tier (keys are "<namespace>:<model fingerprint>:<key>").
    remote_namespace: str = "kvboost"
    # Seconds a shared-tier read may take in all (its value's transfer included) before the
    # tier is skipped for a back-off; background writes get it per socket operation.
    remote_timeout: float = 0.5
    # How passage and session KV is stored on disk and in the shared tier: "none" (as
    # computed), "int8" or "fp8" (one byte per element, 2x smaller than bf16; measured in
    # docs/bench/remote-*.txt). Exact prefix blocks are never coded. One of KV_CODECS.
    kv_codec: str = "none"
    # Signs every entry written to disk and Redis (HMAC-SHA256) and rejects entries read
    # without a valid signature: whoever can write the shared folder or server but lacks
    # the secret cannot plant KV. None reads the KVBOOST_CACHE_SECRET environment variable;
    # unset, entries are checksummed only (damage is caught, malice is not).
    cache_secret: str | bytes | None = field(default=None, repr=False)
    # How tool calls look in the model's output: "auto" reads the chat template (Hermes
    # tags when it has no tool support), or one of TOOL_FORMATS ("hermes",
    # "json", "llama3").
    tool_format: str = "auto"
    # Decode tool calls and JSON answers under a grammar (llguidance), so they are valid
    # even from a small model; a request's constrain= overrides it.
    constrained_decoding: bool = True
    # Tool results (Hermes format: Qwen, and templates without tool support) written in a
    # user turn as a sentence naming the call and its answer, in <tool_response> tags,
    # followed by a request for the answer or the next call (core/tools/template.py,
    # noted_result): Qwen2.5-Coder used a result only so. False: the template's rendering.
    tool_result_notes: bool = True
    # Requests decoding together in one forward per step (continuous batching): 1 decodes
    # one request at a time; None: 8 on CPU (where a 2-core step costs about 1.3x one
    # request's at 8), 32 on a GPU.
    max_batch_size: int | None = None
    # Bytes of KV the executor's rows may hold at once (every request decoding or being
    # built on this model): a request that would take them past it waits for rows to end
    # instead of running the process out of memory; one alone always runs. None: half the
    # memory free on the model's device when the engine is made.
    kv_budget_bytes: int | None = None
    # Prompt-lookup speculation (core/generation/speculation.py): each decoding step also
    # verifies up to this many tokens drafted from the request's own text; the answer is the
    # same (greedy: token for token in fp32, up to rounding in bf16; sampled: the same
    # distribution). 0 turns it off; None: the measured default for the device (8 on CPU;
    # at most 1 a row while several rows decode together, fed only while drafts are kept
    # often enough to pay). A request's ``draft_tokens=`` overrides it.
    draft_tokens: int | None = None
    # The engine's forwards apply the lm_head on its weight prepacked for oneDNN
    # (core/model/packed.py: 10.4 against 27.4 ms at 8 rows on SmolLM2, 2-core CPU, fp32),
    # at the cost of one more copy of the head in memory. None: on a CPU where the decoder
    # plus the packed head give the model's own logits and the head measures faster; True:
    # wherever they give its logits; False: never. Requests of engines that disagree
    # decode together packed only if none said False.
    packed_head: bool | None = None
    # The engine's forwards compute the decoder's linear layers on their weights prepacked
    # for oneDNN where that measures faster at the forward's row count
    # (core/model/linears.py: SmolLM2's at 900 rows 1.15 against 1.58 s, at 9 rows 27
    # against 73 ms, 2-core CPU, fp32), at the cost of a second copy of those weights in
    # memory (for decoders whose linear weights take up to a quarter of the machine's memory;
    # Qwen2.5-Coder-1.5B in bf16 packs on 16 GiB). False: this engine does not make the
    # model keep that copy; a model none of whose engines allow it keeps none, and once
    # one does, every engine on the model takes it (one speed profile a model).
    packed_linears: bool = True
    # A one-request decoding step compiled by torch.compile (inductor, weights frozen,
    # core/generation/compiled.py): SmolLM2-135M's one-token step took 25-28 against 36-41
    # ms eager at the warm-up's check (bf16, 2-core CPU; fp32 72 against 75). Compiling
    # costs a minute or two when the first such engine on a model is built (inductor
    # caches it on disk for later processes) and about one more copy of the linear
    # weights. "off": never; "measured": compile, check its logits against the eager
    # step's, and take it for steps of one request feeding one token where it measured
    # faster; "on": take it wherever the check passed. ``stats().batch.compiled_state``
    # says whether it runs, or why not.
    compiled_step: CompiledStepChoice = "off"
    # Keep what the first engine on a model measures at start (its linear layers' fastest
    # way per row count, the packed head's check, the RoPE probe) in small JSON files under
    # the cache root (~/.cache/kvboost-rag/measurements), keyed by the CPU, the software
    # versions and the model's shapes, dtype or fingerprint, so a later start on this
    # machine recalls them instead of measuring again (Qwen2.5-Coder-1.5B: several seconds).
    # False: measure at every start, keep nothing.
    remember_measurements: bool = True

    def __post_init__(self) -> None:
        check_field_types(self)  # first: the range checks below compare values of its types
        check_fidelity(self.fidelity)
        _check_choice("passage_prefix", self.passage_prefix, PassagePrefix)
        _check_choice("prefix_fallback", self.prefix_fallback, PrefixFallback)
        if self.tool_format != "auto" and self.tool_format not in TOOL_FORMATS:
            raise ValueError(
                f"tool_format must be 'auto' or one of {sorted(TOOL_FORMATS)}, "
                f"got {self.tool_format!r}"
            )
        _check_remote(self)
        if self.kv_codec not in KV_CODECS:
            raise ValueError(f"kv_codec must be one of {KV_CODECS}, got {self.kv_codec!r}")
        if self.max_cache_bytes < 0:
            raise ValueError(f"max_cache_bytes must be >= 0, got {self.max_cache_bytes}")
        if not 1 <= self.block_tokens <= 4096:
            raise ValueError(f"block_tokens must be in [1, 4096], got {self.block_tokens}")
        if self.repair is not None and self.repair not in REPAIR_STRATEGIES:
            raise ValueError(
                f"repair must be one of {sorted(REPAIR_STRATEGIES)}, got {self.repair!r}"
            )
        if self.recompute_ratio is not None and not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.edge_tokens is not None and self.edge_tokens < 0:
            raise ValueError(f"edge_tokens must be >= 0, got {self.edge_tokens}")
        if self.max_disk_bytes < 0:
            raise ValueError(f"max_disk_bytes must be >= 0, got {self.max_disk_bytes}")
        if self.recompute_mass is not None and not 0.0 < self.recompute_mass <= 1.0:
            raise ValueError(f"recompute_mass must be in (0, 1], got {self.recompute_mass}")
        if self.recompute_mass is not None and self._strategy() != "query":
            raise ValueError(
                f"recompute_mass applies to the 'query' repair only; this config repairs with "
                f"{self._strategy()!r} (set repair='query')"
            )
        if self.probe_layers is not None and self.probe_layers < 1:
            raise ValueError(f"probe_layers must be >= 1, got {self.probe_layers}")
        if self.max_batch_size is not None and (
            isinstance(self.max_batch_size, bool)
            or not isinstance(self.max_batch_size, int)
            or self.max_batch_size < 1
        ):
            raise ValueError(
                f"max_batch_size must be an int >= 1 (1 = no batching) or None (auto), "
                f"got {self.max_batch_size!r}"
            )
        if self.kv_budget_bytes is not None and (
            isinstance(self.kv_budget_bytes, bool)
            or not isinstance(self.kv_budget_bytes, int)
            or self.kv_budget_bytes < 1
        ):
            raise ValueError(
                f"kv_budget_bytes must be an int >= 1 or None (half the device's free "
                f"memory), got {self.kv_budget_bytes!r}"
            )
        if self.draft_tokens is not None and (
            isinstance(self.draft_tokens, bool)
            or not isinstance(self.draft_tokens, int)
            or not 0 <= self.draft_tokens <= 64
        ):
            raise ValueError(
                f"draft_tokens must be an int in [0, 64] (0 = no speculation) or None (auto), "
                f"got {self.draft_tokens!r}"
            )
        if self.packed_head is not None and not isinstance(self.packed_head, bool):
            raise ValueError(
                f"packed_head must be True, False or None (auto), got {self.packed_head!r}"
            )
        for name in ("packed_linears", "remember_measurements"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _check_choice("compiled_step", self.compiled_step, CompiledStepChoice)
        if self.cache_dir is not None and not str(self.cache_dir):
            raise ValueError('cache_dir must be a folder, got "" (pass "." for this one)')
        for name in ("max_passage_tokens", "encode_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def secret(self) -> bytes | None:
        """The cache secret as bytes: ``cache_secret``, else $KVBOOST_CACHE_SECRET, else None."""
        value = self.cache_secret or os.environ.get(SECRET_ENV) or None
        return value.encode() if isinstance(value, str) else value

    def batch_size(self, device: torch.device) -> int:
        """``max_batch_size``, or its default for ``device``."""
        if self.max_batch_size is not None:
            return self.max_batch_size
        return 8 if device.type == "cpu" else 32

    def kv_budget(self, device: torch.device) -> int:
        """``kv_budget_bytes``, or half the memory free on ``device`` now (no limit where
        that is unknown)."""
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes
        free = free_memory(device)
        return sys.maxsize if free is None else free // 2

    def draft_length(self, device: torch.device) -> int:
        """``draft_tokens``, or its default for ``device``."""
        if self.draft_tokens is not None:
            return self.draft_tokens
        return DEFAULT_DRAFT_TOKENS.get(device.type, 0)

    def _strategy(self) -> str | None:
        """The repair strategy this config runs; None at fidelity "exact"."""
        if self.fidelity == "exact":
            return None
        return self.repair or FIDELITY_REPAIR[self.fidelity].strategy

    def repair_settings(self) -> RepairSettings | None:
        """The repair to run for reused passages; None in "exact" fidelity."""
        strategy = self._strategy()
        if strategy is None:
            return None
        base = FIDELITY_REPAIR[self.fidelity]
        return replace(
            base,
            strategy=strategy,
            recompute_ratio=_pick(self.recompute_ratio, base.recompute_ratio),
            edge_tokens=_pick(self.edge_tokens, base.edge_tokens),
            # The level's probe depth was measured for its own strategy only: a deviation
            # probe over 8 layers cost 448 ms where its own 2 cost 78 ms.
            probe_layers=_pick(
                self.probe_layers, base.probe_layers if strategy == base.strategy else None
            ),
            recompute_mass=_pick(self.recompute_mass, base.recompute_mass),
        )


# Drafted tokens verified per decoding step, by device, where speculation measured faster
# (docs/bench/decode-bfloat16.txt: on a CPU a step verifying 8 drafted tokens costs about
# one plain step, and RAG answers copy their passages); elsewhere off, as not measured.
# In bf16 on a 2-core Xeon a lone row fed 9 tokens took 0.99x one fed 1 at
# Qwen2.5-Coder-1.5B, 1.12x at 0.5B, 1.26x at SmolLM2-135M, and 17 tokens 1.35x / 1.73x /
# 1.27x (``scripts/step_constants.py --parts draft``, docs/bench/constants-*). Kept.
DEFAULT_DRAFT_TOKENS: dict[str, int] = {"cpu": 8}


def _check_remote(config: KVBoostConfig) -> None:
    if config.remote_url is not None:
        check_url(config.remote_url)
    if not config.remote_namespace or any(c.isspace() for c in config.remote_namespace):
        raise ValueError(
            f"remote_namespace must be non-empty without spaces, got {config.remote_namespace!r}"
        )
    if not config.remote_timeout > 0:
        raise ValueError(f"remote_timeout must be > 0 seconds, got {config.remote_timeout}")


def _check_choice(name: str, value: object, choices: object) -> None:
    if value not in get_args(choices):
        raise ValueError(f"{name} must be one of {get_args(choices)}, got {value!r}")


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` (a CPU's: the host's available memory), None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
