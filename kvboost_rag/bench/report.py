"""Markdown tables from benchmark JSON, so the README's numbers are a run's numbers.

python -m kvboost_rag.bench.report docs/bench/rag-levels-bfloat16.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


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


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> None:
    for path in argv if argv is not None else sys.argv[1:]:
        report = json.loads(Path(path).read_text())
        print(f"<!-- {Path(path).name} -->")
        print(chat_table(report) if "turns" in report else rag_tables(report))


if __name__ == "__main__":
    main()
