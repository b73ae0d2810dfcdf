"""The tables of ``bench.remote``: printed, and kept as the text file beside the JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Say = Callable[[str], None]


def print_report(result: dict[str, Any], say: Say) -> None:
    m, load, src = result["machine"], result["load_average"], result["source"]
    commit = (src["git_commit"] or "no git")[:7] + (
        " + local core/ edits" * bool(src["core_differs_from_commit"])
    )
    say(
        f"{result['model']} {m['dtype']} on {m['cpu']} (torch threads={m['threads']}), fidelity "
        f"{result['fidelity']}, redis-server {result['redis']['version']}; load average "
        f"{load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end; "
        f"{result['seconds'] / 60:.1f} min; core {src['core_sha256']} ({commit}), the same in "
        "every process"
    )
    warming(result, say)
    serving(result["serve"], say)
    storage(result["codecs"], say)
    codec_serving(result["codecs"], say)


def warming(result: dict[str, Any], say: Say) -> None:
    warm = result["warm"]
    first = warm["runs"][0]
    say(
        f"\n1. Warming {first['documents']} essay units ({first['tokens']} tokens) with "
        f"warm_corpus into a fresh cache_dir, alone (a) or with Redis write-through (b); "
        f"order {' '.join('b' if t != 'disk' else 'a' for t in warm['order'])}"
    )
    say(f"{'target':<28}{'tokens/s':>9}  {'runs (tokens/s)':<20}{'Redis MiB written/used':>24}")
    for tier, label in (("disk", "(a) cache_dir"), ("disk + redis", "(b) cache_dir + Redis")):
        runs = [r for r in warm["runs"] if r["tier"] == tier]
        rate = warm["disk_tokens_per_s" if tier == "disk" else "redis_tokens_per_s"]
        each = ", ".join(f"{r['tokens_per_s']:.0f}" for r in runs)
        mib = "-"
        if tier != "disk":
            written, used = runs[-1]["redis_written_bytes"], runs[-1]["redis_used_bytes"]
            mib = f"{written / 2**20:.0f} / {used / 2**20:.0f}"
        say(f"{label:<28}{rate:>9.0f}  {each:<20}{mib:>24}")
    say(f"{'ratio (b) / (a)':<28}{warm['ratio']:>8.2f}x")


def serving(served: dict[str, Any], say: Say) -> None:
    redis = served["redis"]
    say(
        f"\n2. A fresh process serves {redis['queries']} RAG prompts of 7 warmed units each "
        "(no unit in two prompts), each request started once the previous one's writes were "
        "done; TTFT medians in ms, p90 in brackets"
    )
    say(
        f"{'process: first read from':<34}{'first':>13}{'again (memory)':>17}{'full prefill':>15}"
        f"{'speedup':>9}{'encoded':>9}"
    )
    labels = {
        "redis": "B: Redis (own empty cache_dir)",
        "disk": "C: disk (B's cache_dir, no Redis)",
    }
    for tier, s in served.items():
        say(
            f"{labels[tier]:<34}{_ms(s, 'first'):>13}{_ms(s, 'again'):>17}{_ms(s, 'full'):>15}"
            f"{s['full_ttft_ms'] / s['first_ttft_ms']:>8.2f}x{s['passages_encoded']:>9}"
        )
    remote = redis["remote"]
    say(
        f"B: {redis['passages_hit_first']} passages hit on first serving, "
        f"{redis['passages_missed']} missed, {redis['passages_foreign']} foreign, "
        f"{redis['passages_encoded']} encoded; Redis {remote['hits']} hits, "
        f"{remote['misses']} misses, {remote['errors']} errors; B wrote {remote['writes']} "
        f"values through over {redis['requests']} requests "
        f"({remote['written_bytes'] / 2**20:.2f} MiB in all)"
    )


def storage(codecs: dict[str, Any], say: Say) -> None:
    rows = codecs["codecs"]
    some = next(iter(rows.values()))
    say(
        f"\n3a. Codecs: bytes per token of passage KV ({some['computed_bytes_per_token']:.0f} as "
        f"computed) and cost per passage (median of {some['passages_timed']} passages of "
        f"~{some['passage_tokens']:.0f} tokens)"
    )
    say(
        f"{'codec':<7}{'stored B/tok':>13}{'Redis written':>14}{'Redis used':>11}{'vs none':>9}"
        f"{'encode ms':>11}{'decode ms':>11}"
    )
    plain = rows.get("none", {}).get("redis_used_bytes_per_token")
    for name, r in rows.items():
        ratio = f"{r['redis_used_bytes_per_token'] / plain:.2f}x" if plain else "-"
        say(
            f"{name:<7}{r['stored_bytes_per_token']:>13.0f}{r['written_bytes_per_token']:>14.0f}"
            f"{r['redis_used_bytes_per_token']:>11.0f}{ratio:>9}{r['encode_ms']:>11.1f}"
            f"{r['decode_ms']:>11.1f}"
        )


def codec_serving(codecs: dict[str, Any], say: Say) -> None:
    full = codecs["full_prefill"]
    say(
        f"\n3b. Codecs on the fact workload: {codecs['queries']} prompts of 7 passages "
        f"(median {codecs['median_prompt_tokens']:.0f} tokens) from a pool of "
        f"{codecs['pool_passages']}, the same prompts for every codec; TTFT medians in ms; "
        "answers (16 greedy tokens) with passages read from Redis"
    )
    say(
        f"{'codec':<14}{'Redis':>7}{'disk':>7}{'memory':>8}{'acc%':>6}{'top1%':>7}"
        f"{'greedy16%':>10}{'KL':>8}{'=none%':>8}"
    )
    for name, r in codecs["codecs"].items():
        same = "-" if r["same_as_none_pct"] is None else f"{r['same_as_none_pct']:.0f}"
        say(
            f"{name:<14}{r['redis_ttft_ms']:>7.0f}{r['disk_ttft_ms']:>7.0f}"
            f"{r['memory_ttft_ms']:>8.0f}{r['accuracy_pct']:>6.0f}{r['top1_agreement_pct']:>7.0f}"
            f"{r['greedy16_match_pct']:>10.0f}{r['mean_kl']:>8.4f}{same:>8}"
        )
    say(f"{'full prefill':<14}{full['ttft_ms']:>7.0f}{'':>15}{full['accuracy_pct']:>6.0f}")
    faults = [
        f"{name} {tier} {r[f'{tier}_passages_missed']}"
        for name, r in codecs["codecs"].items()
        for tier in ("redis", "disk", "memory")
        if r[f"{tier}_passages_missed"]
    ]
    errors = sum(r["reader_redis"]["errors"] for r in codecs["codecs"].values())
    say(
        f"passages a tier failed to serve (encoded instead): {', '.join(faults) or 'none'}; "
        f"Redis errors seen by the readers: {errors}"
    )


def _ms(s: dict[str, Any], column: str) -> str:
    return f"{s[f'{column}_ttft_ms']:.0f} [{s[f'{column}_p90_ttft_ms']:.0f}]"
