"""What a user sees when the shared Redis tier fails: per fault, what reached the caller,
requests completed, and wrong serves (which must be 0).

    python -m kvboost_rag.bench.faults [--out DIR] [--quick] [--threads N] [--cluster]

The embedded model in float32 answers completion prompts of 3 essay passages (~50-100
tokens each, with an invented fact; ``generate(question, passages=...)``) with 8 greedy
tokens. Every fault gets its own private ``redis-server`` (``fault_server``), broken on
purpose while an engine warms the corpus into it or serves prompts from it: the server's
faults are in ``fault_cases`` (down, killed, restarted, frozen, a slow link, flushed, out
of memory, evicting), the values' in ``fault_values`` (damaged, two writers). With
``--cluster`` the shared tier is a 3-master Redis Cluster (``cluster_server``) and the
faults are ``fault_cluster``'s (a master killed, a failover, slots migrating, a master out
of memory). ``fault_watch`` records what the caller saw; ``fault_report`` prints the table
and writes ``faults.txt`` / ``faults.json`` (``faults-cluster.*``) under ``--out``.

Wrong serve: a request whose token ids differ from those of a reference engine with no
shared tier (same config otherwise) that warmed the corpus locally. A request takes one
of two routes, and each is compared with the reference's answer on that route: passages
assembled and repaired (reused tokens > 0), or, when more than half of its passage tokens
were missing from every tier, a plain prefill (``core.plan.COLD_SHARE``), compared with
the same engine's plain prefill. Passages are encoded one per forward pass
(``encode_batch_tokens=1``): in a padded batch a passage's KV differs in the last bits
with its batch-mates, so a passage encoded alone by the serving engine after a fault
would not be comparable with its warmed copy. No two prompts start with the same passage,
so no request can reuse another's exact prefix or session KV: a request's answer
depends on its passages' KV alone. The "no fault" row is the control: its engine reads
every passage from Redis, and the values are compared with locally encoded KV bit for bit.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvboost_rag import GenerationResult, KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.arguments import ArgumentParser, positive
from kvboost_rag.bench.corpus import FactPassage, fact_passages, passages
from kvboost_rag.bench.fault_server import RedisProcess
from kvboost_rag.bench.fault_watch import Watch, close, row, watching
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
        cache = self.reference._reuse.cache  # type: ignore[union-attr]
        (tokens,) = self.reference._prompts.passages([text])
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
            local = self.reference._store.memory.get(key, None)
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


def run_all(lab: Lab, cases: list[tuple[str, Callable[[Lab, Watch], None]]]) -> list[dict]:
    rows = []
    for name, case in cases:
        start = time.perf_counter()
        with watching(name) as watch:
            try:
                case(lab, watch)
            except Exception as error:  # noqa: BLE001 -- the bench's own fault: reported
                watch.note(f"BENCH ERROR (not the engine's): {type(error).__name__}: {error}")
        rows.append(row(watch, time.perf_counter() - start))
        close(watch)
        print(f"  {name}: {rows[-1]['seconds']:.0f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    from kvboost_rag.bench import fault_cases, fault_cluster, fault_report, fault_values

    parser = ArgumentParser(
        prog="kvboost-rag bench faults", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--quick", action="store_true", help="10 passages, 3 prompts")
    parser.add_argument("--passages", type=positive, default=None, help="default 24 (quick 10)")
    parser.add_argument("--queries", type=positive, default=None, help="default 8 (quick 3)")
    parser.add_argument("--threads", type=positive, default=None, help="torch threads")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="the faults of a 3-master Redis Cluster instead (faults-cluster.txt / .json)",
    )
    parser.add_argument("--writer", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    count = args.passages or (10 if args.quick else 24)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.writer:
        fault_values.write_corpus(args.writer, count)
        return
    start = time.perf_counter()
    base = KVBoost.from_pretrained(MODEL, dtype="float32", config=engine_config(None))
    pool = make_pool(base.tokenizer, count)
    queries = make_queries(pool, args.queries or (3 if args.quick else 8), seed=1)
    lab = Lab(base, pool, queries)
    try:
        rows = run_all(lab, fault_cluster.CASES if args.cluster else fault_cases.CASES)
    finally:
        shutil.rmtree(lab.folder, ignore_errors=True)
    report = fault_report.report(lab, rows, time.perf_counter() - start)
    fault_report.write(args.out, report, "faults-cluster" if args.cluster else "faults")


if __name__ == "__main__":
    main()
