"""What the LangChain and LlamaIndex adapters share: the engine they wrap, the options they
forward, the statistics they report and the way they hand documents to the engine.

Framework-free on purpose: each adapter imports its framework, this module imports neither.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import importlib.util
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, Field

from kvboost_rag.core.config import KVBoostConfig, check_fidelity
from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.generation.sampling import MAX_SEED, SamplingOptions
from kvboost_rag.core.model import openmp
from kvboost_rag.core.prompt.chunker import format_passages, split_passage
from kvboost_rag.core.results import GenerationResult
from kvboost_rag.documents import document_texts

DEFAULT_MODEL = "smollm2-135m-instruct"


def require(module: str, extra: str) -> None:
    """Raise ``ImportError`` with the install hint when an optional framework is missing.
    Each adapter package calls this before importing its framework."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{module} is not installed; install it with: pip install 'kvboost-rag[{extra}]'"
        )


def load_engine(
    model_id: str = DEFAULT_MODEL,
    *,
    fidelity: str | None = None,
    dtype: Any = None,
    device: Any = None,
    weights: str | None = None,
    config: KVBoostConfig | None = None,
    **model_kwargs: Any,
) -> KVBoost:
    """A new engine for ``model_id``; ``fidelity`` overrides the config's level."""
    config = config or KVBoostConfig()
    if fidelity is not None:
        config = dataclasses.replace(config, fidelity=check_fidelity(fidelity))
    return KVBoost.from_pretrained(
        model_id, dtype=dtype, device=device, weights=weights, config=config, **model_kwargs
    )


def check_engine_fidelity(engine: KVBoost, fidelity: str | None) -> None:
    """A wrapped engine's fidelity is fixed when it is built: a different one asked of the
    adapter would be ignored, so it is an error."""
    if fidelity is not None and check_fidelity(fidelity) != engine.config.fidelity:
        raise ValueError(
            f"fidelity={fidelity!r} differs from the wrapped engine's "
            f"{engine.config.fidelity!r}; build the engine with "
            f"KVBoostConfig(fidelity={fidelity!r}) or leave fidelity unset"
        )


class SamplingFields(BaseModel):
    """The sampling settings both adapters take: as fields (the defaults) and, by the same
    names, as per-call options (LangChain ``invoke(..., temperature=0.7)``, LlamaIndex
    ``complete(..., max_tokens=8)``)."""

    # strict: pydantic would otherwise read True as 1 and "0.5" as 0.5.
    max_tokens: int = Field(
        default=256, ge=1, strict=True, description="Most new tokens per answer."
    )
    temperature: float = Field(
        default=0.0, ge=0.0, strict=True, allow_inf_nan=False, description="0 decodes greedily."
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, strict=True, description="Nucleus sampling mass."
    )
    top_k: int = Field(default=0, ge=0, strict=True, description="Top-k sampling; 0 disables it.")
    seed: int | None = Field(
        default=None, ge=0, le=MAX_SEED, strict=True, description="Makes sampling reproducible."
    )
    stop: list[str] | None = Field(
        default=None, description="Stop strings; the text ends before the first one."
    )

    def engine_options(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The engine's keyword options: these fields, with a call's ``overrides`` (any
        of ``SAMPLING_OPTIONS``; None keeps the field) on top. Validated here, so a bad
        value fails before the model runs."""
        given = overrides or {}
        chosen = {
            k: getattr(self, k) if given.get(k) is None else given[k] for k in SAMPLING_OPTIONS
        }
        sampling = SamplingOptions.build(
            max_new_tokens=_max_tokens(chosen["max_tokens"]),
            temperature=chosen["temperature"],
            top_p=chosen["top_p"],
            top_k=chosen["top_k"],
            seed=chosen["seed"],
            stop=chosen["stop"],
        )
        return {**dataclasses.asdict(sampling), "stop": list(sampling.stop) or None}


SAMPLING_OPTIONS: tuple[str, ...] = tuple(SamplingFields.model_fields)


def _max_tokens(value: Any) -> int:
    """A call's ``max_tokens`` checked by the engine's rule, refused by the adapters' name
    for it (the engine's ``max_new_tokens`` is not what the caller passed)."""
    try:
        return SamplingOptions(max_new_tokens=value).max_new_tokens
    except ValueError:
        raise ValueError(f"max_tokens must be an int >= 1, got {value!r}") from None


def result_stats(result: GenerationResult) -> dict[str, Any]:
    """How one answer was made, for ``response_metadata`` / ``additional_kwargs``."""
    return {
        "ttft_ms": round(result.ttft_ms, 3),
        "total_ms": round(result.total_ms, 3),
        "kv_reuse_ratio": round(result.kv_reuse_ratio, 4),
        "prompt_tokens": result.prompt_tokens,
        "reused_tokens": result.reused_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "completion_tokens": result.completion_tokens,
        "passages_hit": result.passages_hit,
        "passages_missed": result.passages_missed,
        "passages_unused": result.passages_unused,
        "passages_foreign": result.passages_foreign,
        "reuse_reason": result.reuse_reason,
        # Why the answer was decoded again as text ("" if it was not), and the repeated
        # calls the repeat guard withheld (``core/retry.py``).
        "retried": result.retried,
        "withheld_tool_calls": [
            {"name": c.name, "arguments": c.arguments} for c in result.withheld_tool_calls
        ],
        # OpenAI's name for an answer that ends in tool calls, which both frameworks read.
        "finish_reason": result.finish_reason,
        "timings": result.timings.as_dict(),
    }


def documents_as_passages(documents: Sequence[Any]) -> str:
    """Documents (strings, LangChain Documents, LlamaIndex nodes) as marked passages, laid
    out as ``format_passages`` lays them out."""
    return format_passages(document_texts(documents))


def split_into_units(text: str, tokenizer: Any, max_passage_tokens: int) -> list[str]:
    """``text`` cut at sentence boundaries into pieces the engine caches whole: each piece
    fits ``max_passage_tokens``. Pieces join back to ``text``."""
    return [piece for piece in split_passage(text, tokenizer, max_passage_tokens) if piece.strip()]


_END = object()
T = TypeVar("T")
R = TypeVar("R")

# Async callers get a thread of their own per call. asyncio's default executor has
# min(32, cores + 4) threads (6 on a 2-core machine): eight concurrent ``ainvoke`` calls
# would reach the engine six at a time, and a streaming caller's next chunk would wait
# behind them. A thread per call ends with it (a pool would keep idle threads for the
# whole process) and is not a daemon: like asyncio's executor, exit waits for it rather
# than killing it inside torch.


async def in_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread`` without the default executor's thread limit (context
    variables kept)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(error: BaseException | None, value: Any) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def run() -> None:
        try:
            outcome: tuple[BaseException | None, Any] = (None, context.run(fn, *args, **kwargs))
        except BaseException as error:  # handed to the awaiting task, raised there
            outcome = (error, None)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody awaits this call any more
            pass

    threading.Thread(target=run, name="kvboost-async").start()
    return await future


def concurrently(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(item) for item in items]`` with every call in flight at once, so the engine
    decodes them in one batch; results in order, the first error raised. The calling thread
    only waits meanwhile, so it frees its OpenMP pool (``core/model/openmp.py``)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    openmp.release_pool()
    with ThreadPoolExecutor(max_workers=len(items), thread_name_prefix="kvboost-batch") as pool:
        calls = [contextvars.copy_context() for _ in items]
        return list(pool.map(lambda pair: pair[0].run(fn, pair[1]), zip(calls, items)))


async def aiter_thread(source: Iterator[Any], close: Any = None) -> AsyncIterator[Any]:
    """Iterate a blocking iterator from async code: each ``next`` runs in a worker thread,
    so the event loop keeps running while the model works. ``close`` (if given) runs when
    the consumer stops early, cancelling the generation behind ``source``."""
    finished = False
    try:
        while True:
            item = await in_thread(next, source, _END)
            if item is _END:
                finished = True
                return
            yield item
    finally:
        if not finished and close is not None:
            await in_thread(close)
