"""What routing replicas by passage affinity would gain: real per-passage costs measured on
this machine, then routers simulated with them.

    .venv/bin/python scripts/affinity_routing.py --model smollm2-135m-instruct --dtype float32
        --out docs/bench/affinity-routing-smollm2-135m-instruct-float32.json
        [--k 4] [--rounds 8] [--threads 1] [--passage-tokens 300] [--costs RECORD.json]

1. Measured (``affinity_costs.py``): the time to first token of a RAG prompt of ``--k``
   essay passages (200 to ``--passage-tokens`` tokens) whose KV is in the replica's memory
   tier, only in the shared Redis tier (a replica whose memory never held them), or nowhere
   (encoded), and with e of k passages encoded; ``--rounds`` interleaved rounds on the real
   engine and a private ``redis-server``; medians, and what a passage read from Redis
   instead of memory costs, paired on the same prompt. Also a passage's KV bytes in
   memory and the bytes Redis sent per passage read (``total_net_output_bytes``). The
   timed part holds ``--lock`` (waiting while another benchmark holds it).
2. Simulated (``affinity_sim.py``): 2, 4 and 8 replicas, each with a memory tier of
   ``KVBoostConfig().max_cache_bytes`` that also keeps each request's prompt (measured:
   what an all-memory call left in the tier), Zipf s 0.6 / 1.0 / 1.2 with Redis warmed
   and s 1.0 with Redis empty at first, the routers of ``affinity_sim.routers``; each
   request's TTFT estimate is the measured cost of its mix (service time: queueing on a
   busier replica is not in it; the load imbalance is shown beside it), and again with
   each Redis read's bytes at ``--link-gbit``. ``--costs`` simulates again from a
   record's measured calls, with no model.

Prints the tables; writes the JSON, ``.txt`` and (with matplotlib) ``.png`` beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules

import affinity_sim as sim  # noqa: E402
from affinity_costs import costs, measure  # noqa: E402

from kvboost_rag import KVBoostConfig  # noqa: E402
from kvboost_rag.bench.common.transcript import note  # noqa: E402

# what --costs takes from a record
MEASURED = {"machine", "redis", "calls", "costs", "redis_bytes_per_passage", "as_intended"}
MEASURED |= {"passage_kv_bytes", "prompt_kv_bytes", "load_average"}
MEASURED |= {"runs", "date", "model", "rounds", "k", "measured_by"}


def simulate(record: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The routers on the measured costs; also each row's mean TTFT were Redis a
    ``--link-gbit`` network away (its reads' bytes at that rate, added)."""
    table: sim.Costs = {}
    for mix, cost in record["costs"].items():
        m, r, e = map(int, mix.split(","))
        table[(m, r, e)] = cost
    link_ms = record["redis_bytes_per_passage"] * 8 / (args.link_gbit * 1e9) * 1e3
    memory, rows = sim.Memory(record["memory_passages"], record["prompt_passages"]), []
    for warmed, zipfs in ((True, args.zipf), (False, args.cold_zipf)):
        for s in zipfs:
            note(f"simulating zipf s={s}, Redis {'warmed' if warmed else 'empty'}")
            w = sim.Workload(args.corpus, k=args.k, zipf=s, requests=args.requests, warmed=warmed)
            rows += sim.compare(w, args.replicas, memory, table)
    for row in rows:
        row["redis_reads_per_request"] = row["redis_share"] * args.k
        row["ttft_mean_over_link_ms"] = (
            row["ttft_mean_ms"] + row["redis_reads_per_request"] * link_ms
        )
    return rows


def cost_lines(record: dict[str, Any]) -> list[str]:
    k, rounds = record["k"], record["rounds"]
    names = {
        "memory": f"all {k} in the replica's memory tier (a)",
        "redis": f"all {k} only in Redis (b)",
        "encoded": f"all {k} nowhere: encoded (c)",
        **{f"{e} of {k} encoded": f"{e} of {k} encoded, the rest in memory" for e in range(1, k)},
        "redis read": "a passage from Redis, not memory: (b - a) / k",
    }
    lines = [f"{'':46} {'median':>7} {'min':>7} {'max':>7} {'cost':>7}  as meant"]
    for key, name in names.items():
        c = record["calls"][key]
        cells = " ".join(f"{c[x]:7.0f}" for x in ("median", "min", "max", "scaled"))
        meant = record["as_intended"].get(key)
        lines.append(f"{name:46} {cells}" + (f"  {meant}/{rounds}" if meant is not None else ""))
    return lines


FORMATS = {"memory_share": ".1%", "redis_share": ".1%", "encode_share": ".1%", "imbalance": ".2f"}
FORMATS["redis_reads_per_request"] = ".2f"


def router_lines(rows: list[dict[str, Any]], link: str) -> list[str]:
    keys = ["memory_share", "redis_share", "encode_share", "ttft_mean_ms", "ttft_p50_ms"]
    keys += ["ttft_p99_ms", "imbalance", "redis_reads_per_request", "ttft_mean_over_link_ms"]
    heads = ["memory", "redis", "encode", "TTFT mean", "p50", "p99", "max/mean", "reads/req"]
    heads += [f"mean {link}"]
    lines = [f"{'Redis':6} {'s':>3} {'R':>2} {'router':31} " + " ".join(f"{h:>9}" for h in heads)]
    for row in rows:
        cells = [f"{row[k]:9{FORMATS.get(k, '.0f')}}" for k in keys]
        lines.append(
            f"{row['redis']:6} {row['zipf']:3.1f} {row['replicas']:2} {row['router']:31} "
            + " ".join(cells)
        )
    return lines


def text(record: dict[str, Any]) -> str:
    m = record["machine"]
    w = record["workload"]
    head = [
        f"measured: {record['measured_by']}",
        f"simulated: {record['command']}",
        f"{record['date']}, {m['cpu']} ({m['cpu_count']} cores, {m['threads']} threads), "
        f"{record['model']} {m['dtype']}, redis {record['redis']['version']}, load average "
        + " -> ".join(f"{a[0]:.1f}" for a in record["load_average"].values()),
        "",
        f"TTFT ms of a {record['k']}-passage prompt by where its passages' KV is, "
        f"{record['rounds']} interleaved rounds (cost: the median share of its round's (c), "
        "times (c)'s median):",
        *cost_lines(record),
        "",
        f"a passage: {record['passage_kv_bytes'] / 2**20:.2f} MiB of KV in memory, "
        f"{record['redis_bytes_per_passage'] / 2**20:.2f} MiB sent by Redis per passage read; "
        f"a replica's memory tier ({record['memory_budget_bytes'] / 2**30:.0f} GiB) holds "
        f"{record['memory_passages']:.0f}, and each request's prompt leaves "
        f"{record['prompt_passages']:.1f} passages' worth of KV in it",
        "TTFT(m in memory, r from Redis, e encoded) = the cost of e encoded with the rest in "
        "memory + r x a Redis read's",
        "",
        f"simulated: {record['requests']} requests over {record['corpus']} passages in topics "
        f"of {w['topic_size']}, {w['topical']:.0%} of a request's passages from its topic, "
        "Redis warmed with all of them or empty at first (TTFT estimate: the cost of each "
        "request's mix, no queueing; the last column adds each Redis read's bytes at "
        f"{record['link_gbit']:g} Gb/s, Redis on another machine):",
        *router_lines(record["rows"], f"{record['link_gbit']:g}Gb/s"),
    ]
    return "\n".join(head) + "\n"


def draw(record: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note("matplotlib is not installed: no chart")
        return
    warmed = [r for r in record["rows"] if r["redis"] == "warmed"]
    zipfs = sorted({r["zipf"] for r in warmed})
    fig, grid = plt.subplots(1, len(zipfs), figsize=(5 * len(zipfs), 4), sharey=True, squeeze=False)
    axes = list(grid[0])
    for ax, s in zip(axes, zipfs):
        rows = [r for r in warmed if r["zipf"] == s]
        for name in dict.fromkeys(r["router"] for r in rows):
            mine = [r for r in rows if r["router"] == name]
            ax.plot([r["replicas"] for r in mine], [r["ttft_mean_ms"] for r in mine], "o-")
            ax.lines[-1].set_label(name)
        ax.set(title=f"Zipf s={s}", xlabel="replicas", xticks=sorted({r["replicas"] for r in rows}))
    axes[0].set_ylabel(f"mean TTFT estimate, ms ({record['model']})")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, required=True, help="the record's JSON path")
    parser.add_argument("--k", type=int, default=4, help="passages a prompt")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--passage-tokens", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lock", default="/tmp/kvboost-bench.lock")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's); 1 keeps a "
        "forward from waiting on a core other work holds",
    )
    parser.add_argument("--costs", type=Path, help="a record whose measured calls to reuse")
    parser.add_argument("--memory-passages", type=float, help="default: the memory budget's")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--zipf", type=float, nargs="+", default=[0.6, 1.0, 1.2])
    parser.add_argument(
        "--cold-zipf", type=float, nargs="*", default=[1.0], help="also with Redis empty"
    )
    parser.add_argument("--link-gbit", type=float, default=1.0, help="the last column's link")
    parser.add_argument("--corpus", type=int, default=10_000, help="passages simulated")
    parser.add_argument("--requests", type=int, default=40_000, help="requests simulated")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.costs:  # what was measured, as it was recorded; the costs made from its calls
        measured = {k: v for k, v in json.loads(args.costs.read_text()).items() if k in MEASURED}
        measured |= costs(measured["runs"], measured["k"])
    else:
        measured = measure(args) | {"date": datetime.date.today().isoformat()}
        measured |= {"model": args.model, "rounds": args.rounds, "k": args.k}
        measured["measured_by"] = " ".join([".venv/bin/python", *sys.argv])
    args.k = measured["k"]
    budget = KVBoostConfig().max_cache_bytes
    record = measured | {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "memory_budget_bytes": budget,
        "memory_passages": args.memory_passages or budget / measured["passage_kv_bytes"],
        # what each request's prompt leaves in the memory tier (cache_generated), in passages
        "prompt_passages": (measured["prompt_kv_bytes"] or 0) / measured["passage_kv_bytes"],
        "corpus": args.corpus,
        "link_gbit": args.link_gbit,
        "requests": args.requests,
        "workload": sim.Workload().__dict__ | {"zipf": args.zipf, "replicas": args.replicas},
    }
    record["rows"] = simulate(record, args)
    report = text(record)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".txt").write_text(report)
    draw(record, args.out.with_suffix(".png"))
    note(f"wrote {args.out} and its .txt / .png")


if __name__ == "__main__":
    main()
