"""What one request returns: the text and an honest account of how it was made."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Literal

from kvboost_rag.core.store.disk import DiskStats
from kvboost_rag.core.store.memory import StoreStats
from kvboost_rag.core.store.remote import RemoteStats
from kvboost_rag.core.tools.formats import InvalidToolCall, ToolCall

# "tool_calls": the answer ended after calling tools (a "stop" with calls in it).
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]


def elapsed_ms(since: float) -> float:
    """Wall milliseconds since a ``time.perf_counter()`` reading."""
    return (time.perf_counter() - since) * 1e3


@dataclass
class Timings:
    """Milliseconds spent in each stage of one request (wall clock)."""

    tokenize_ms: float = 0.0  # prompt parsing and tokenization
    lookup_ms: float = 0.0  # cache key hashing and lookups, tier reads included
    wait_ms: float = 0.0  # queued for the model (other requests' builds and steps)
    encode_ms: float = 0.0  # encoding passages that were not cached yet
    assemble_ms: float = 0.0  # building the model's cache from stored KV (with re-rotation)
    repair_ms: float = 0.0  # choosing the reused tokens to recompute
    prefill_ms: float = 0.0  # the forwards computing what is left, up to the first token
    decode_ms: float = 0.0  # every token after the first
    store_ms: float = 0.0  # copying new KV out for later requests (after the last token;
    # the stores themselves are queued off the request path)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items()}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Adds the wall time of the ``with`` block to ``{name}_ms``."""
        attr = f"{name}_ms"
        assert hasattr(self, attr), f"no stage {name!r}"
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, attr, getattr(self, attr) + elapsed_ms(start))


@dataclass
class GenerationResult:
    """One completed request.

    ``ttft_ms`` is wall time from the call to the first generated token, everything included.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from a cache
    recomputed_tokens: int  # prompt tokens whose KV was computed for this request
    ttft_ms: float
    total_ms: float
    timings: Timings = field(default_factory=Timings)
    # Passages of the prompt after its exact prefix, each counted once among: ``hit``, its
    # stored KV used (some positions of it kept after the repair); ``unused``, the cache held
    # it but the answer did not use it (the policy prefilled the prompt plainly, as
    # ``reuse_reason`` says, or the repair recomputed all of it); ``missed``, the cache did
    # not hold it (encoded for this request when others were reused, and cached).
    passages_hit: int = 0
    passages_missed: int = 0
    # Of the hits, passages whose KV was encoded after another prompt prefix than this
    # one's (the "nearest" fallback): close to, not equal to, what the prompt's own prefix
    # gives. Warm with prefix= to make it 0.
    passages_foreign: int = 0
    # How the engine reused the prompt and why (the reuse policy's words): e.g. "reuse: 3
    # of 3 passages cached: reused and repaired", "prefill: no passage after the exact prefix".
    reuse_reason: str = ""
    passages_unused: int = 0  # see ``passages_hit``
    # Calls the answer made when tools were offered (``text`` is then the content outside
    # them), and output that looked like a call but could not be read as one.
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)
    # Calls the answer wrote that the repeat guard withheld: each repeats a call the
    # messages already hold with its result, so the answer was decoded again as text.
    withheld_tool_calls: list[ToolCall] = field(default_factory=list)
    # Why the answer was decoded again as text ("" when it was not): a withheld repeat, or
    # an answer that offered tools and held neither text nor a call (``core/retry.py``).
    retried: str = ""

    @property
    def kv_reuse_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class WarmResult:
    """What one warm call did: ``warm(text)`` (a prefix), ``warm_passages(texts)`` or
    ``warm_corpus(documents)`` (passages)."""

    documents: int  # texts given (skipped ones included)
    units: int  # cache entries they make: passage pieces, or prefix blocks
    tokens: int  # tokens in those units
    cached: int  # units already cached (memory or disk) before this call
    new: int  # units computed and stored by this call
    # KV bytes of the units some tier holds once the call returns (``dropped`` ones not
    # counted): what the cache then holds of this warm
    bytes: int
    seconds: float  # wall time of the call (on disk too, when the engine has a cache_dir)
    skipped: int = 0  # texts left out with a warning: empty or only whitespace
    # Units no tier holds once the call returns: more KV than max_cache_bytes (and
    # max_disk_bytes) hold, so the oldest were evicted again; warned about
    dropped: int = 0
    # Tiers that did not store the warm, by their own stats: "disk" (cache_dir set but it
    # cannot hold a cache), "remote" (the shared tier failed or was unavailable; warned
    # about). The CLI's ``warm`` exits 1 for these. A disk write that fails raises instead.
    failed: tuple[str, ...] = ()
    # Per text given (``warm_passages``): the passages it was split into, pieces of at most
    # ``max_passage_tokens`` tokens (0: skipped); a piece given twice is still one unit.
    pieces: tuple[int, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """All tokens (cached ones included) over the wall time."""
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class EngineStats:
    cache: StoreStats  # the memory tier: size, entries, hits, misses, evictions
    disk: DiskStats | None  # the disk tier (None without cache_dir)
    requests: int  # completed generate/chat/stream calls
    prompt_tokens: int  # summed over requests
    reused_tokens: int  # prompt tokens served from cache, summed over requests
    remote: RemoteStats | None = None  # the shared tier (None without remote_url)
    # Decoding steps of the model's batcher (shared by engines on one model): how many,
    # and how many requests they decoded in all and at most at once.
    batch: BatchStats | None = None


@dataclass(frozen=True)
class BatchStats:
    steps: int  # forwards over the batch
    rows: int  # request-steps decoded in them (rows / steps: the mean batch)
    peak: int  # the most requests decoded in one step
    seconds: float = 0.0  # spent in steps (forward and token choice): rows / seconds is
    # the batch's decoding throughput in tokens/s
    compiled_steps: int = 0  # of ``steps``, taken by the compiled one-row step
    # (``KVBoostConfig.compiled_step``): "off", "on", or why the eager step runs instead
    compiled_state: str = "off"
    # its warm-up check's step times, ms: (compiled, eager), where it compiled
    compiled_check_ms: tuple[float, float] | None = None
    compiled_seconds: float = 0.0  # the warm-up's compile, where it compiled
    kv_peak_bytes: int = 0  # the most the rows' KV buffers held (``kv_budget_bytes``)
