"""The fidelity front's tables and Pareto chart, from its report (``front.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.front.measure import PLACES

MAIN = "format_passages"  # the layout of the tables the chart and BOS table are drawn from


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or a dash of the same width when it was not measured."""
    return format("-", spec.split(".")[0]) if value is None else format(value, spec)


def print_cell(cell: dict[str, Any]) -> None:
    found = cell["retrieval_found_pct"]
    print(
        f"\n{cell['name']}: {cell['passages']} passages, median "
        f"{cell['median_prompt_tokens']:.0f} prompt tokens, {cell['queries']} queries, "
        f"pool {cell['pool_passages']}" + ("" if found is None else f", retrieved {found:.0f}%")
    )
    print(
        f"{'option':<26}{'TTFT ms':>9}{'p90':>8}{'speedup':>9}{'TTLT x':>8}{'kept':>7}"
        f"{'acc%':>6}{'share%':>7}"
        f"{'greedy%':>8}{'KL':>7}{'top1%':>6}{'foreign':>8}{'missed':>7}"
        f"{'first/middle/last acc%':>24}{'computed%':>10}{'probe ms':>9}"
    )
    for name, s in cell["systems"].items():
        places = s.get("accuracy_by_place_pct") or {}
        by_place = "/".join(_fmt(places.get(p), ".0f").strip() or "-" for p in PLACES)
        print(
            f"{name:<26}{s['median_ttft_ms']:>9.1f}{s['p90_ttft_ms']:>8.1f}{s['speedup']:>8.2f}x"
            f"{s['ttlt_speedup']:>7.2f}x{'{}/{}'.format(*s['kept']):>7}"
            f"{_fmt(s['accuracy_pct'], '>6.0f')}{_fmt(s['accuracy_share_pct'], '>7.0f')}"
            f"{_fmt(s['greedy16_match_pct'], '>8.0f')}{_fmt(s['mean_kl'], '>7.3f')}"
            f"{_fmt(s['top1_agreement_pct'], '>6.0f')}{_fmt(s['passages_foreign'], '>8.2f')}"
            f"{_fmt(s['passages_missed'], '>7.2f')}{by_place:>24}"
            f"{_fmt(s.get('computed_pct'), '>10.1f')}{_fmt(s.get('probe_ms'), '>9.1f')}"
        )


def totals(cells: dict[str, Any]) -> dict[str, Any]:
    """Per option, over ``cells``: full prefill's right answers it kept (right here too), and
    the geometric mean of its per-cell TTFT and TTLT speed-ups."""
    out: dict[str, Any] = {}
    for cell in cells.values():
        for name, s in cell["systems"].items():
            t = out.setdefault(name, {"kept": [0, 0], "ttft": [], "ttlt": []})
            t["kept"] = [t["kept"][0] + s["kept"][0], t["kept"][1] + s["kept"][1]]
            t["ttft"].append(s["speedup"])
            t["ttlt"].append(s["ttlt_speedup"])
    return {
        name: {
            "kept": t["kept"],
            "kept_pct": 100 * t["kept"][0] / t["kept"][1] if t["kept"][1] else None,
            "ttft_speedup": math.prod(t["ttft"]) ** (1 / len(t["ttft"])),
            "ttlt_speedup": math.prod(t["ttlt"]) ** (1 / len(t["ttlt"])),
        }
        for name, t in out.items()
    }


def print_totals(table: dict[str, Any]) -> None:
    print("\nEvery cell: full prefill's right answers kept, speed-ups (geometric mean of cells)")
    print(f"{'option':<26}{'kept':>9}{'kept%':>7}{'TTFT x':>8}{'TTLT x':>8}")
    for name, t in table.items():
        kept = "{}/{}".format(*t["kept"])
        print(
            f"{name:<26}{kept:>9}{_fmt(t['kept_pct'], '>7.1f')}"
            f"{t['ttft_speedup']:>7.2f}x{t['ttlt_speedup']:>7.2f}x"
        )


def bos_vs_prefix(cells: dict[str, Any], options: Sequence[str]) -> dict[str, Any]:
    """Per option (of ``options``) and task: accuracy share, answer KL and speed-up in the
    1k table, passages encoded after BOS (anchor) beside the prompt's prefix."""
    main = [
        c for c in cells.values() if (c["layout"], c["passages"], c["warm"]) == (MAIN, 4, "all")
    ]
    keys = ("accuracy_share_pct", "accuracy_pct", "mean_kl", "speedup")
    return {
        name: {c["task"]: {k: c["systems"][name][k] for k in keys} for c in main}
        for name in options
        if all(name in c["systems"] for c in main)
    }


def print_prefix(table: dict[str, Any]) -> None:
    tasks = list(next(iter(table.values()))) if table else []
    if not tasks:  # no 1k all-warmed cell ran (``--sizes 8``)
        return
    print(f"\nBOS vs real prefix (1k, {MAIN}, all warmed): accuracy share, answer KL, speed-up")
    print(f"{'option':<22}" + "".join(f"{t + ' share%':>14}{'KL':>7}{'speedup':>9}" for t in tasks))
    for name, row in table.items():
        print(
            f"{name:<22}"
            + "".join(
                f"{_fmt(row[t]['accuracy_share_pct'], '>14.0f')}{row[t]['mean_kl']:>7.3f}"
                f"{row[t]['speedup']:>8.2f}x"
                for t in tasks
            )
        )


def draw_front(report: dict[str, Any], path: Path) -> Path:
    """Write ``path`` (PNG): one panel per task (rows) and prompt size (columns) of the
    all-warmed tables in the package's layout, each option at (speed-up, accuracy share);
    an option without a share (full prefill answered nothing right) is left out. Needs
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    except ImportError as err:
        raise ImportError("the chart needs: pip install 'kvboost-rag[examples]'") from err
    panels = [c for c in report["cells"].values() if (c["layout"], c["warm"]) == (MAIN, "all")]
    tasks = sorted({c["task"] for c in panels}, key=[c["task"] for c in panels].index)
    sizes = sorted({c["passages"] for c in panels})
    width = max(6 * len(sizes), 11)
    fig, axes = plt.subplots(
        len(tasks), len(sizes), figsize=(width, 4.5 * len(tasks) + 1), squeeze=False
    )
    names = list(panels[0]["systems"])
    markers = ["os^vDP*Xph"[i % 10] for i in range(len(names))]
    colors = [f"C{i % 10}" for i in range(len(names))]
    for cell in panels:
        ax = axes[tasks.index(cell["task"])][sizes.index(cell["passages"])]
        for name, marker, color in zip(names, markers, colors):
            s = cell["systems"][name]
            if s["accuracy_share_pct"] is not None:
                ax.scatter(s["speedup"], s["accuracy_share_pct"], s=60, marker=marker, c=color)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{cell['name']} ({cell['queries']} queries)", fontsize=9)
        ax.set_xlabel("TTFT speed-up vs full prefill (log)")
        ax.set_ylabel("accuracy, % of full prefill's")
        ax.axhline(100, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    handles = [
        Line2D([], [], ls="", markersize=8, marker=m, color=c) for m, c in zip(markers, colors)
    ]
    fig.legend(handles, names, loc="lower center", ncol=5, fontsize=8)
    m = report["machine"]
    fig.suptitle(
        f"{report['model']} {m['dtype']} on {m['device']} ({m['threads']} threads): "
        f"{report['command']}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def markdown(report: dict[str, Any], cell_names: Sequence[str]) -> str:
    """The README's tables: one per named cell of ``report``, every option in it."""
    out = []
    for name in cell_names:
        cell = report["cells"][name]
        out.append(
            f"`{name}`: {cell['passages']} passages, median {cell['median_prompt_tokens']:.0f} "
            f"prompt tokens, {cell['queries']} queries\n\n"
            "| option | TTFT ms | p90 | speed-up | accuracy | share of full | greedy = full "
            "| answer KL |\n|---|---|---|---|---|---|---|---|"
        )
        for option, s in cell["systems"].items():
            out.append(
                f"| {option} | {s['median_ttft_ms']:.0f} | {s['p90_ttft_ms']:.0f} "
                f"| {s['speedup']:.2f}x | {_fmt(s['accuracy_pct'], '.0f')}% "
                f"| {_fmt(s['accuracy_share_pct'], '.0f')}% "
                f"| {_fmt(s['greedy16_match_pct'], '.0f')}% | {_fmt(s['mean_kl'], '.3f')} |"
            )
        out.append("")
    return "\n".join(out).replace("| -% ", "| - ")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks.front.report FILE.json CELL...``: README tables."""
    import json
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    report = json.loads(Path(args[0]).read_text())
    print(markdown(report, args[1:] or list(report["cells"])))


if __name__ == "__main__":
    main()
