"""The fault benchmark's laboratory: the model and corpus every case shares, the engines
it builds on a server, the queries and their reference answers. Below the cases, the
values and the watch, which import it; ``run.py`` above them all."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.redis_server import RedisProcess
from kvboost_rag import GenerationResult, KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.bench.common.corpus import FactPassage, fact_passages, passages
from kvboost_rag.core.store import codec

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 8
PER_PROMPT = 3
TIMEOUT = 0.5  # remote_timeout: the bound a slow server may add to a request
NAMESPACE = "kvboost"


def engine_config(url: str | None) -> KVBoostConfig:
    return KVBoostConfig(remote_url=url, remote_timeout=TIMEOUT, encode_batch_tokens=1)


def make_pool(tokenizer: Any, count: int) -> list[FactPassage]:
    return fact_passages(passages(tokenizer, 100, count), seed=0)


@dataclass(frozen=True)
class Query:
    question: str
    passages: tuple[str, ...]


def make_queries(pool: list[FactPassage], n: int, seed: int) -> list[Query]:
    """Prompt i starts with passage i (no two share a first passage), then random others."""
    assert n <= len(pool), "one first passage per prompt"
    rng = random.Random(seed)
    out = []
    for i in range(n):
        docs = [pool[i], *rng.sample(pool[:i] + pool[i + 1 :], PER_PROMPT - 1)]
        out.append(Query(rng.choice(docs).question, tuple(d.text for d in docs)))
    return out


class Lab:
    """What every fault shares: the loaded model, the corpus and prompts, the reference
    engine's answers, and the clean Redis values the control warmed (to seed servers)."""

    def __init__(self, base: KVBoost, pool: list[FactPassage], queries: list[Query]) -> None:
        self.base = base
        self.texts = [p.text for p in pool]
        self.queries = queries
        self.folder = Path(tempfile.mkdtemp(prefix="kvboost-faults-"))
        self.reference = self.engine(None)
        warm_corpus(self.reference, self.texts, progress=False)
        self.expected = [self.ask(self.reference, i).token_ids for i in range(len(queries))]
        self._plain = KVBoost(base.model, base.tokenizer, KVBoostConfig(fidelity="exact"))
        self._prefilled: dict[int, list[int]] = {}
        self.golden: dict[bytes, bytes] = {}  # Redis name -> value, as the control warmed
        self.fingerprint = self.reference.fingerprint.hex()

    def engine(self, url: str | None) -> KVBoost:
        return KVBoost(self.base.model, self.base.tokenizer, engine_config(url))

    def ask(self, engine: KVBoost, i: int) -> GenerationResult:
        q = self.queries[i]
        return engine.generate(q.question, passages=list(q.passages), max_new_tokens=NEW_TOKENS)

    def expected_for(self, i: int, result: GenerationResult) -> list[int]:
        """The reference's answer to prompt ``i`` on the route ``result`` took."""
        if result.reused_tokens:  # passages assembled and repaired
            return self.expected[i]
        if i not in self._prefilled:  # a plain prefill: no exact prefix is shared
            self._plain.clear_cache()
            self._prefilled[i] = self.ask(self._plain, i).token_ids
        return self._prefilled[i]

    def passage_name(self, text: str) -> bytes:
        """The Redis key of ``text``'s passage KV (encoded after BOS, as ``warm_corpus``)."""
        cache = self.reference.inspect.passage_cache
        assert cache is not None, "passage reuse is off"
        (tokens,) = self.reference.inspect.passages([text])
        key = cache.key(cache.prefix([]), tokens)
        return f"{NAMESPACE}:{self.fingerprint}:{key.hex()}".encode()

    def seed(self, server: RedisProcess) -> None:
        """Fill ``server`` with the control's clean values (a warm without the encoding)."""
        client = server.client()
        for name, data in self.golden.items():
            client.set(name, data)

    def check_values(self, server: RedisProcess) -> str:
        """Whether every value under this model's keys decodes as the entry of its key, and
        whether it equals the reference's locally encoded KV bit for bit."""
        client = server.client()
        names = list(client.scan_iter(match=f"{NAMESPACE}:{self.fingerprint}:*", count=1000))
        valid = compared = equal = 0
        for name in names:
            key = bytes.fromhex(name.decode().split(":")[2])
            try:
                entry = codec.from_bytes(client.get(name) or b"", key, self.fingerprint)
            except ValueError:
                continue
            valid += 1
            local = self.reference.inspect.tiers.memory.get(key, None)
            if local is not None:
                compared += 1
                equal += all(
                    torch.equal(a, b) for mine, theirs in zip(local.kv, entry.kv)
                    for a, b in zip(mine, theirs)
                ) and len(local.kv) == len(entry.kv)  # fmt: skip
        return (
            f"{valid}/{len(names)} values decode, {equal}/{compared} bit-equal to the "
            "reference's locally encoded KV"
        )
