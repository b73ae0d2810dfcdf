"""The summary, table and chart of ``bench.latency``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvboost_rag.bench.common.chart import save
from kvboost_rag.bench.common.metrics import median

BASE = "generate"
NOTES = [
    "x: generate's median over the system's (above 1: faster). pair: the median over "
    "requests of generate's time over the system's on the same prompt (one slow request "
    "moves it less). ms/token: time after the first token over the tokens after it. same: "
    "greedy tokens equal to generate's.",
    "floor: one forward of only the prompt's tokens after its last passage over a ready "
    "cache (what TTFT cannot beat). background: work an engine deferred after the answer "
    "(encoding a cold prompt's passages), waited for between requests, on no clock.",
]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (scenario, length, system): medians over requests, ratios to generate."""
    keys = list(dict.fromkeys((r["scenario"], r["length"]) for r in rows))
    out = []
    for scenario, length in keys:
        group = [r for r in rows if (r["scenario"], r["length"]) == (scenario, length)]
        systems = list(group[0]["runs"])
        base = _stats(group, BASE)
        for system in systems:
            line = {
                "scenario": scenario,
                "length": length,
                "system": system,
                **_stats(group, system),
            }
            line["floor_ms"] = median([r["floor_ms"] for r in group])
            for key in ("ttft_ms", "ttlt_ms", "ms_per_token"):
                own = line[key]
                line[f"{key}_x"] = base[key] / own if own and base[key] else None
            for key in ("ttft_ms", "ttlt_ms"):
                line[f"{key}_paired_x"] = median(
                    [r["runs"][BASE][key] / r["runs"][system][key] for r in group]
                )
            out.append(line)
    return out


def _stats(group: list[dict[str, Any]], system: str) -> dict[str, Any]:
    runs = [r["runs"][system] for r in group]
    base = [r["runs"][BASE] for r in group]
    per_token = [
        (run["ttlt_ms"] - run["ttft_ms"]) / (len(run["token_ids"]) - 1)
        for run in runs
        if len(run["token_ids"]) > 1
    ]
    return {
        "requests": len(runs),
        "ttft_ms": median([run["ttft_ms"] for run in runs]),
        "ttlt_ms": median([run["ttlt_ms"] for run in runs]),
        "ms_per_token": median(per_token) if per_token else None,
        "tokens": median([len(run["token_ids"]) for run in runs]),
        "same": sum(run["token_ids"] == b["token_ids"] for run, b in zip(runs, base)),
        "reused_pct": 100 * sum(r["reused"] for r in runs) / max(1, sum(r["prompt"] for r in runs)),
        "background_ms": median([run.get("background_ms", 0.0) for run in runs]),
    }


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"{report['model']} {m['dtype']} on {m['cpu']} ({m['cpu_count']} cores, "
        f"{m['threads']} threads), torch {m['torch']}, transformers {m['transformers']}",
        f"command: {report['command']}",
    ]
    head = (
        f"{'system':<13}{'TTFT ms':>9}{'x':>6}{'pair':>6}{'TTLT ms':>10}{'x':>6}{'pair':>6}"
        f"{'ms/tok':>8}{'x':>6}"
        f"{'same':>7}{'reused':>8}{'backgr ms':>10}"
    )
    current = None
    for line in report["summary"]:
        key = (line["scenario"], line["length"])
        if key != current:
            current = key
            lines += [
                "",
                f"{line['scenario']}, {line['length']} new tokens ({line['requests']} requests; "
                f"floor {line['floor_ms']:.0f} ms)",
                head,
            ]
        lines.append(
            f"{line['system']:<13}{line['ttft_ms']:>9.0f}{_x(line['ttft_ms_x'])}"
            f"{_x(line.get('ttft_ms_paired_x'))}{line['ttlt_ms']:>10.0f}{_x(line['ttlt_ms_x'])}"
            f"{_x(line.get('ttlt_ms_paired_x'))}{_f(line['ms_per_token'])}"
            f"{_x(line['ms_per_token_x'])}{line['same']:>4}/{line['requests']:<2}"
            f"{line['reused_pct']:>7.0f}%{line['background_ms']:>10.0f}"
        )
    return "\n".join([*lines, "", *NOTES])


# What the headline names each system (README and docs/bench/latency.md).
HEADLINE_NAMES = {
    "generate": "`model.generate` (full prefill: what HuggingFacePipeline / HuggingFaceLLM run)",
    "prefix cache": "`generate` + transformers' prefix-cache recipe",
    "exact": "kvboost-rag `exact`",
    "balanced": "kvboost-rag `balanced` (default)",
    "fast": "kvboost-rag `fast`",
}


def headline(report: dict[str, Any], scenario: str = "warm") -> str:
    """The one table the README leads with: per system, TTFT and time to last token for
    each answer length against ``generate``, and how many answers equal ``generate``'s.

    Rendered from ``report["summary"]`` for ``scenario``: TTFT is the median of the
    system's per-length medians (the first token does not depend on the answer's length);
    TTLT is given per length above one token; "x" is ``generate``'s time over the system's.
    """
    lines = [line for line in report["summary"] if line["scenario"] == scenario]
    lengths = sorted({line["length"] for line in lines})
    long = [n for n in lengths if n > 1] or lengths
    systems = list(dict.fromkeys(line["system"] for line in lines))
    cell = {(line["system"], line["length"]): line for line in lines}
    base_ttft = median([cell[BASE, n]["ttft_ms"] for n in lengths])
    m = report["machine"]
    requests = cell[BASE, lengths[0]]["requests"]
    caption = (
        f"{report['model']}, {m['dtype']}, {m['cpu']} ({m['cpu_count']} cores, "
        f"{m['threads']} threads); RAG chat prompts of 4 warmed passages in a new order each "
        f"request, {requests} request(s) per answer length, greedy answers of exactly N "
        f"tokens; medians. Command: `{report['command']}`"
        + (" (a quick smoke run: its numbers are placeholders)" if report.get("quick") else "")
    )
    head = ["system", "TTFT", *[f"last token, N={n}" for n in long], "same answer as generate"]
    rows = [caption, "", _row(head), _row(["---"] * len(head))]
    for system in systems:
        ttft = median([cell[system, n]["ttft_ms"] for n in lengths])
        same = sum(cell[system, n]["same"] for n in lengths)
        total = sum(cell[system, n]["requests"] for n in lengths)
        rows.append(
            _row(
                [
                    HEADLINE_NAMES.get(system, system),
                    _ms_x(ttft, base_ttft / ttft if ttft else None),
                    *[
                        _ms_x(cell[system, n]["ttlt_ms"], cell[system, n]["ttlt_ms_x"])
                        for n in long
                    ],
                    f"{same}/{total}",
                ]
            )
        )
    return "\n".join(rows)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _ms_x(ms: float, x: float | None) -> str:
    return f"{ms:,.0f} ms" + (f" ({x:.2f}x)" if x is not None else "")


def _x(value: float | None) -> str:
    return f"{value:>6.2f}" if value is not None else f"{'-':>6}"


def _f(value: float | None) -> str:
    return f"{value:>8.1f}" if value is not None else f"{'-':>8}"


def draw(report: dict[str, Any], path: Path) -> Path:
    """TTFT and TTLT speed-up over generate per system, one group per (scenario, length)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("the chart needs: pip install 'kvboost-rag[examples]'") from err
    summary = report["summary"]
    groups = list(dict.fromkeys((s["scenario"], s["length"]) for s in summary))
    systems = list(dict.fromkeys(s["system"] for s in summary))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    width = 0.8 / len(systems)
    for ax, key, label in ((axes[0], "ttft_ms_x", "TTFT"), (axes[1], "ttlt_ms_x", "TTLT")):
        for i, system in enumerate(systems):
            values = [
                next(
                    s[key] or 0
                    for s in summary
                    if (s["scenario"], s["length"], s["system"]) == (*g, system)
                )
                for g in groups
            ]
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=system)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(
            [g + 0.4 - width / 2 for g in range(len(groups))], [f"{s}\n{n}" for s, n in groups]
        )
        ax.set_ylabel(f"{label} speed-up over generate (x)")
        ax.grid(axis="y", alpha=0.3)
    axes[1].legend()
    return save(fig, report, path)
