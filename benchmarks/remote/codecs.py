"""Storage codecs of the shared tier side by side on one model: bytes per token, encode and
decode cost per passage, TTFT from each tier, and what the codec does to answers.

The workload is ``bench.rag``'s: essay passages each carrying an invented fact, prompts of
the fact passage plus random neighbours from a shared pool. Per codec, a writer engine
warms the pool into its own Redis namespace (and its cache_dir) under that codec. A reader
engine with no cache_dir, its memory emptied before each prompt, takes every passage from
Redis (``NEW_TOKENS`` greedy tokens: the accuracy columns), then the same passages in a
new order from memory; a disk engine on the writer's cache_dir, memory emptied, takes them
from disk. Every codec answers the same prompts, interleaved prompt by prompt beside one
full prefill of the same tokens (the reference), so the comparison is paired.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from benchmarks.remote.server import drop, settle, used_memory
from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common import corpus
from kvboost_rag.bench.common.baseline import full_prefill
from kvboost_rag.bench.common.corpus import FactPassage, messages_for, warm_prefix
from kvboost_rag.bench.common.metrics import kl_div, median, p90
from kvboost_rag.bench.common.transcript import note
from kvboost_rag.core.choices import Fidelity
from kvboost_rag.core.model.kv import LayerKV, kv_nbytes
from kvboost_rag.core.reuse.passage_encoder import PassageEncoder
from kvboost_rag.core.store import codec
from kvboost_rag.core.store.keys import digest

NEW_TOKENS = 16
COST_PASSAGES = 16  # passages whose encode / decode cost is timed per codec


@dataclass
class CodecRun:
    """One codec's engines and what they measured, prompt by prompt."""

    codec: str
    namespace: str
    folder: str  # the writer's cache_dir, read by ``disk``
    reader: KVBoost  # memory -> Redis
    disk: KVBoost  # memory -> the writer's cache_dir
    stored: dict[str, Any]  # what warming the pool put in Redis
    ttft: dict[str, list[float]] = field(
        default_factory=lambda: {"redis": [], "disk": [], "memory": []}
    )
    missed: dict[str, int] = field(default_factory=lambda: {"redis": 0, "disk": 0, "memory": 0})
    answers: list[list[int]] = field(default_factory=list)
    top1: list[bool] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)


Stored = list[tuple[tuple[int, ...], LayerKV]]  # (entry tokens, passage KV) per passage


def passage_kvs(base: KVBoost, texts: Sequence[str]) -> Stored:
    """Each text's KV encoded after the prefix the pool is warmed under, with the tokens its
    entry holds (prefix and passage): what the passage cache stores."""
    prefix = tuple(base.passage_prefix(warm_prefix()))
    pieces = base.inspect.passages(list(texts))
    encoder = PassageEncoder(base.model, base.config.encode_batch_tokens)
    return [(prefix + tuple(pieces[i]), kv) for i, kv in encoder.encode(prefix, pieces)]


def storage(base: KVBoost, name: str, entries: Stored) -> dict[str, Any]:
    """Bytes per token under codec ``name`` and the cost of coding one passage both ways."""
    fingerprint = base.fingerprint.hex()
    encode_ms, decode_ms = [], []
    for i, (tokens, kv) in enumerate(entries):
        key = digest(b"bench", bytes([i]))
        start = time.perf_counter()
        data = codec.to_bytes(key, fingerprint, tokens, kv, name, True)
        middle = time.perf_counter()
        codec.from_bytes(data, key, fingerprint)
        encode_ms.append((middle - start) * 1e3)
        decode_ms.append((time.perf_counter() - middle) * 1e3)
    kvs = [kv for _, kv in entries]
    kv_tokens = sum(kv[0][0].shape[-2] for kv in kvs)
    return {
        "computed_bytes_per_token": sum(map(kv_nbytes, kvs)) / kv_tokens,
        "stored_bytes_per_token": median([codec.stored_bytes_per_token(kv, name) for kv in kvs]),
        "encode_ms": median(encode_ms),
        "decode_ms": median(decode_ms),
        "passages_timed": len(kvs),
        "passage_tokens": median([kv[0][0].shape[-2] for kv in kvs]),
    }


def open_codec(
    base: KVBoost, url: str, namespace: str, name: str, texts: Sequence[str], fidelity: Fidelity
) -> CodecRun:
    """Warm ``texts`` under codec ``name`` into Redis and a fresh cache_dir; the reader and
    disk engines that serve from them."""
    note(f"warming the {len(texts)}-passage pool into Redis under codec {name}")
    folder = tempfile.mkdtemp(prefix=f"kvboost-codec-{name}-")

    def config(cache_dir: str | None, remote_url: str | None) -> KVBoostConfig:
        """The codec's config over ``cache_dir`` and Redis (``namespace``) where given."""
        if remote_url is None:
            return KVBoostConfig(cache_dir=cache_dir, fidelity=fidelity, kv_codec=name)
        return KVBoostConfig(
            cache_dir=cache_dir,
            remote_url=remote_url,
            remote_namespace=namespace,
            fidelity=fidelity,
            kv_codec=name,
        )

    writer = KVBoost(base.model, base.tokenizer, config(folder, url))
    before = used_memory(url)
    warmed = warm_corpus(writer, texts, prefix=warm_prefix(), progress=False)
    remote = writer.stats().remote
    assert remote is not None
    stored = {
        "tokens": warmed.tokens,
        "writes": remote.writes,
        "written_bytes_per_token": remote.written_bytes / warmed.tokens,
        "redis_used_bytes_per_token": (used_memory(url) - before) / warmed.tokens,
        "warm_tokens_per_s": warmed.tokens_per_s,
    }
    reader = KVBoost(base.model, base.tokenizer, config(None, url))
    disk = KVBoost(base.model, base.tokenizer, config(folder, None))
    return CodecRun(name, namespace, folder, reader, disk, stored)


def answer(run: CodecRun, ref: Any, docs: list[FactPassage], target: FactPassage) -> None:
    """One prompt through ``run``'s tiers: Redis (with the accuracy columns), memory, disk."""
    messages = messages_for(docs, target.question)
    run.reader.clear_cache()
    first = settle(run.reader).chat(messages, max_new_tokens=NEW_TOKENS)
    logits = run.reader.first_token_logits(messages)
    reordered = messages_for(docs[::-1], target.question)
    again = settle(run.reader).chat(reordered, max_new_tokens=1)
    run.disk.clear_cache()
    from_disk = settle(run.disk).chat(messages, max_new_tokens=1)
    for tier, result in (("redis", first), ("memory", again), ("disk", from_disk)):
        run.ttft[tier].append(result.ttft_ms)
        run.missed[tier] += result.passages_missed  # 0 unless the tier failed a read
    run.answers.append(first.token_ids)
    run.top1.append(first.token_ids[:1] == ref.token_ids[:1])
    run.greedy.append(first.token_ids[:NEW_TOKENS] == ref.token_ids[:NEW_TOKENS])
    run.correct.append(target.answer in first.text)
    run.kl.append(kl_div(ref.first_logits, logits))


def summary(run: CodecRun, plain: list[list[int]] | None) -> dict[str, Any]:
    """``plain``: the answers of codec "none" to the same prompts (None when not run)."""
    same = None if plain is None else [a == b for a, b in zip(run.answers, plain)]
    out: dict[str, Any] = {"namespace": run.namespace, **run.stored}
    for tier, values in run.ttft.items():
        out[f"{tier}_ttft_ms"], out[f"{tier}_p90_ttft_ms"] = median(values), p90(values)
        out[f"{tier}_passages_missed"] = run.missed[tier]
    remote = run.reader.stats().remote
    out["reader_redis"] = remote.__dict__ if remote is not None else None
    return out | {
        "accuracy_pct": _pct(run.correct),
        "top1_agreement_pct": _pct(run.top1),
        "greedy16_match_pct": _pct(run.greedy),
        "mean_kl": sum(run.kl) / len(run.kl),
        "same_as_none_pct": None if same is None else _pct(same),
    }


def measure(
    base: KVBoost,
    url: str,
    run_id: str,
    names: Sequence[str],
    pool: list[FactPassage],
    queries: int,
    seed: int,
) -> dict[str, Any]:
    """Every codec in ``names`` over the same ``queries`` prompts of 7 pool passages."""
    texts = [p.text for p in pool]
    entries = passage_kvs(base, texts[:COST_PASSAGES])
    report: dict[str, Any] = {"pool_passages": len(pool), "queries": queries, "codecs": {}}
    runs = [open_codec(base, url, f"{run_id}-{n}", n, texts, base.config.fidelity) for n in names]
    full_ms, full_correct, lengths = [], [], []
    for i, (docs, target) in enumerate(corpus.queries(pool, 7, queries, seed)):
        note(f"codec prompt {i + 1}/{queries}")
        messages = messages_for(docs, target.question)
        for run in runs:
            settle(run.reader)
        ref = full_prefill(base.model, partial(base.tokenize_chat, messages), NEW_TOKENS, True)
        full_ms.append(ref.ttft_ms)
        full_correct.append(target.answer in base.tokenizer.decode(ref.token_ids, True))
        lengths.append(len(base.tokenize_chat(messages)))
        for run in runs:
            answer(run, ref, docs, target)
    plain = next((r.answers for r in runs if r.codec == "none"), None)
    for run in runs:
        report["codecs"][run.codec] = storage(base, run.codec, entries) | summary(run, plain)
        close(url, run)
    report["full_prefill"] = {
        "ttft_ms": median(full_ms),
        "p90_ttft_ms": p90(full_ms),
        "accuracy_pct": _pct(full_correct),
    }
    report["median_prompt_tokens"] = median(lengths)
    return report


def close(url: str, run: CodecRun) -> None:
    drop(url, run.namespace)
    shutil.rmtree(run.folder, ignore_errors=True)
    run.reader = run.disk = None  # type: ignore[assignment]
    gc.collect()


def _pct(values: Sequence[bool]) -> float:
    return 100 * sum(values) / len(values) if values else float("nan")
