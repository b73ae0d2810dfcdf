"""What a user sees when the shared Redis tier fails: per fault, what reached the caller,
requests completed, and wrong serves (which must be 0).

    python -m benchmarks.faults [--out DIR] [--quick] [--threads N] [--cluster]

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
were missing from every tier, a plain prefill (``core.reuse.policy.COLD_SHARE``), compared with
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
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.faults.lab import MODEL, Lab, engine_config, make_pool, make_queries
from benchmarks.faults.watch import Watch, close, row, watching
from kvboost_rag import KVBoost
from kvboost_rag.cli.arguments import ArgumentParser, positive


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
    from benchmarks.faults import cases as fault_cases
    from benchmarks.faults import cluster as fault_cluster
    from benchmarks.faults import report as fault_report
    from benchmarks.faults import values as fault_values

    parser = ArgumentParser(
        prog="python -m benchmarks.faults", description=(__doc__ or "").split("\n")[0]
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
