"""Markdown tables from benchmark JSON, so the documentation's numbers are a run's numbers.

python -m benchmarks.suite.report docs/bench/bench.json ...
python -m benchmarks.suite.report --readme docs/bench/suite.md docs/bench/bench.json

The second form rewrites one page's bench section; ``scripts/docs_pages.py`` rewrites every
generated section of the README and the site, this one included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvboost_rag.cli.arguments import ArgumentParser


def rag_tables(report: dict[str, Any]) -> str:
    out = []
    for size in report["sizes"].values():
        out.append(
            f"{size['passages_per_prompt']} passages per prompt, median "
            f"{size['median_prompt_tokens']:.0f} prompt tokens, {size['queries']} queries; "
            f"floor (question tokens only, over a ready cache) {size['floor_ms']:.0f} ms\n"
        )
        out.append(
            "| system | median TTFT ms | p90 | speed-up | x floor | first-token agreement "
            "| first-token KL | 16-token greedy match | task accuracy | KV reused |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for name, s in size["systems"].items():
            out.append(
                f"| {name} | {s['median_ttft_ms']:.0f} | {s['p90_ttft_ms']:.0f} | "
                f"{s['speedup']:.2f}x | {s['vs_floor']:.2f}x | {_pct(s['top1_agreement_pct'])} | "
                f"{_num(s['mean_kl'])} | {_pct(s['greedy16_match_pct'])} | "
                f"{_pct(s['accuracy_pct'])} | {_pct(s['reuse_pct'])} |"
            )
        out.append("")
    cold = report.get("cold")
    if cold:
        out.append(
            f"Cold path (all {cold['passages_per_prompt']} passages new, {cold['queries']} "
            f"prompts): {cold['engine_ms']:.0f} ms vs full prefill {cold['full_prefill_ms']:.0f}"
            f" ms = {cold['ratio']:.2f}x.\n"
        )
    return "\n".join(out)


def chat_table(report: dict[str, Any]) -> str:
    out = [
        f"{report['dtype']}, median of {report['repeats']} replays\n",
        "| turn | prompt tokens | reused | TTFT ms | full prefill ms | speed-up | same output |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in report["turns"]:
        out.append(
            f"| {t['turn']} | {t['prompt_tokens']} | {t['reused_tokens']} "
            f"({t['reuse_pct']:.0f}%) | {t['ttft_ms']:.0f} | {t['full_prefill_ttft_ms']:.0f} | "
            f"{t['speedup']:.2f}x | {t['identical_output_pct']:.0f}% |"
        )
    d = report["decode"]
    out.append(
        f"\nDecode after the first token: {d['engine_tok_s']:.1f} tokens/s on a reused cache "
        f"vs {d['generate_tok_s']:.1f} for plain `generate` ({d['ratio']:.3f}x).\n"
    )
    return "\n".join(out)


RAG_HEAD = (
    "| system | median TTFT ms | p90 | speed-up | x floor | first-token agreement "
    "| first-token KL | 16-token greedy match | task accuracy | KV reused | decode tok/s "
    "| request peak MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)
TITLES = {
    "rag-1k": "RAG, retrieval order, ~1k-token prompts",
    "rag-2k": "RAG, retrieval order, ~2k-token prompts",
    "popular": "Shared pool of popular passages (Zipf), nothing warmed",
}


def machine_line(report: dict[str, Any]) -> str:
    m = report["machine"]
    return (
        f"Machine: {m['cpu']} ({m['cpu_count']} cores, {m['memory_gib']} GiB), device "
        f"{m['device']}, {m['threads']} torch threads; torch {m['torch']}, transformers "
        f"{m['transformers']}, Python {m['python']}. Model {report['model']} in {m['dtype']}. "
        f"Peak memory: {m['peak_memory_method']}. Whole run {report['wall_s'] / 60:.1f} min."
    )


def bench_markdown(report: dict[str, Any], chart: str | None = None) -> str:
    """The README's benchmark section body from ``bench.json``: every table of the run."""
    out = [machine_line(report), "", "```bash", report["command"], "```", ""]
    if chart:
        out += [f"![TTFT and task accuracy per system]({chart})", ""]
    for name, title in TITLES.items():
        size = report["workloads"][name]
        out.append(
            f"**{title}**: {size['passages_per_prompt']} passages per prompt, median "
            f"{size['median_prompt_tokens']:.0f} prompt tokens, {size['queries']} queries; floor "
            f"(question tokens only, over a ready cache) {size['floor_ms']:.0f} ms\n"
        )
        out += [RAG_HEAD, *(_rag_line(n, s) for n, s in size["systems"].items()), ""]
    out += _losses(report) + _cold(report["workloads"]["cold"])
    out += _chat(report["workloads"]["chat"]) + _warm(report)
    return "\n".join(out)


def _losses(report: dict[str, Any]) -> list[str]:
    """Where each system loses accuracy: its task accuracy beside full prefill's, and KL."""
    out = ["Where accuracy is lost (task accuracy vs full prefill's; mean first-token KL):\n"]
    names = [n for n in report["workloads"]["rag-1k"]["systems"] if n != "full prefill"]
    for name in names:
        parts = []
        for workload in TITLES:
            rows = report["workloads"][workload]["systems"]
            s, full = rows[name], rows["full prefill"]
            parts.append(
                f"{workload} {_pct(s['accuracy_pct'])} vs {_pct(full['accuracy_pct'])} "
                f"(KL {_num(s['mean_kl'])})"
            )
        out.append(f"- {name}: " + ", ".join(parts))
    return [*out, ""]


def _rag_line(name: str, s: dict[str, Any]) -> str:
    floor = "-" if s["vs_floor"] is None else f"{s['vs_floor']:.2f}x"
    return (
        f"| {name} | {s['median_ttft_ms']:.0f} | {s['p90_ttft_ms']:.0f} | {s['speedup']:.2f}x "
        f"| {floor} | {_pct(s['top1_agreement_pct'])} | {_num(s['mean_kl'])} "
        f"| {_pct(s['greedy16_match_pct'])} | {_pct(s['accuracy_pct'])} | {_pct(s['reuse_pct'])} "
        f"| {_num(s['decode_tok_s'], 1)} | {_num(s['peak_request_mib'], 0)} |"
    )


def _cold(cold: dict[str, Any]) -> list[str]:
    out = [
        f"**Cold start**: {cold['queries']} prompts of {cold['passages_per_prompt']} passages "
        f"no system had seen (median {cold['median_prompt_tokens']:.0f} tokens)\n",
        "| system | median TTFT ms | p90 | speed-up | request peak MiB |",
        "|---|---|---|---|---|",
    ]
    for name, s in cold["systems"].items():
        out.append(
            f"| {name} | {s['median_ttft_ms']:.0f} | {s['p90_ttft_ms']:.0f} | "
            f"{s['speedup']:.2f}x | {_num(s['peak_request_mib'], 0)} |"
        )
    return [*out, ""]


def _chat(chat: dict[str, Any]) -> list[str]:
    out = [
        f"**6-turn chat**: every turn holds the whole history; median over turns of "
        f"{chat['repeats']} replay(s), each beside a full prefill of the same tokens\n",
        "| system | median TTFT ms | p90 | full prefill ms | speed-up | history reused "
        "| same output as full prefill |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in chat["systems"].items():
        out.append(
            f"| {name} | {s['median_ttft_ms']:.0f} | {s['p90_ttft_ms']:.0f} | "
            f"{s['full_prefill_ttft_ms']:.0f} | {s['speedup']:.2f}x | {_pct(s['reuse_pct'])} | "
            f"{_pct(s['identical_output_pct'])} |"
        )
    return [*out, ""]


def _warm(report: dict[str, Any]) -> list[str]:
    out = [
        "Warming the RAG pool before the RAG workloads (not in any TTFT): "
        + "; ".join(f"{n} {w['seconds']:.1f} s" for n, w in report["warm"].items())
        + ". KV held after the RAG and popular workloads: "
        + "; ".join(f"{n} {mib:.0f} MiB" for n, mib in report["cache_mib"].items())
        + "."
    ]
    peer = report.get("peer")
    if peer:
        out.append(
            f"\nPeer: kvboost {peer['version']} with its defaults ({peer['chunk_size']}-token "
            f"chunks, {peer['recompute_strategy']} repair). Its own `ttft_ms` starts after "
            f"cache assembly and repair (median {peer['self_reported_median_ttft_ms']:.0f} ms "
            "here); the tables time it from the call, like every other system."
        )
    for name, why in report["not_run"].items():
        out.append(f"\n{name}: {why}.")
    return [*out, ""]


def print_bench(report: dict[str, Any]) -> None:
    print(bench_markdown(report, report.get("chart")))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


START, END = "<!-- bench.json: start -->", "<!-- bench.json: end -->"


def update_readme(readme: Path, bench_json: Path) -> None:
    """Replace what lies between the README's bench markers with ``bench_json``'s tables."""
    text = readme.read_text(encoding="utf-8")
    if text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{readme} needs one {START!r} and one {END!r} line")
    report = json.loads(bench_json.read_text())
    chart = bench_json.with_name("bench.png").relative_to(readme.resolve().parent)
    head, rest = text.split(START)
    body = bench_markdown(report, chart.as_posix())
    readme.write_text(f"{head}{START}\n{body}\n{END}{rest.split(END)[1]}", encoding="utf-8")
    print(f"updated {readme} from {bench_json}")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog="python -m benchmarks.suite.report", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("json", nargs="+", type=Path, help="benchmark JSON files")
    parser.add_argument(
        "--readme", type=Path, help="rewrite the bench section of this page (docs/bench/index.md)"
    )
    args = parser.parse_args(argv)
    for path in args.json:
        report = json.loads(path.read_text())
        if "workloads" in report and args.readme:
            update_readme(args.readme, path.resolve())
            continue
        print(f"<!-- {path.name} -->")
        if "workloads" in report:
            print(bench_markdown(report, str(path.with_name("bench.png"))))
        else:
            print(chat_table(report) if "turns" in report else rag_tables(report))


if __name__ == "__main__":
    main()
