"""The benchmark's chart: median TTFT per system and workload, task accuracy beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORKLOADS = ("rag-1k", "rag-2k", "popular")


def draw(report: dict[str, Any], path: Path) -> Path:
    """Write ``path`` (PNG) from a ``bench.json`` report; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    except ImportError as err:
        raise ImportError("the chart needs: pip install 'kvboost-rag[examples]'") from err
    names = list(report["workloads"]["rag-1k"]["systems"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.6 * len(names) + 2.5))
    height = 0.8 / len(WORKLOADS)
    for i, workload in enumerate(WORKLOADS):
        rows = report["workloads"][workload]["systems"]
        ys = [y + i * height for y in range(len(names))]
        ttft = [rows[n]["median_ttft_ms"] for n in names]
        accuracy = [rows[n]["accuracy_pct"] or 0 for n in names]
        left.barh(ys, ttft, height, label=workload)
        right.barh(ys, accuracy, height, label=workload)
    ticks = [y + 0.4 - height / 2 for y in range(len(names))]
    for ax, label in ((left, "median TTFT (ms, log scale)"), (right, "task accuracy (%)")):
        ax.set_yticks(ticks, names)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    left.set_xscale("log")
    left.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    left.xaxis.set_major_formatter(ScalarFormatter())
    left.xaxis.set_minor_formatter(NullFormatter())
    right.set_xlim(0, 100)
    right.legend(loc="lower right")
    return save(fig, report, path)


def save(fig: Any, report: dict[str, Any], path: Path) -> Path:
    """Title ``fig`` with the model, machine and command of ``report``; write it to
    ``path`` (PNG) and close it."""
    import matplotlib.pyplot as plt

    m = report["machine"]
    fig.suptitle(
        f"{report['model']} {m['dtype']} on {m['device']} ({m['cpu_count']} cores, "
        f"{m['threads']} threads): {report['command']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path
