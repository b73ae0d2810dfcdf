"""The summary, table and chart of ``bench.decode``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvboost_rag.bench.common.chart import save
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.core.model.quantized import WEIGHTS

BASE = "generate"
KINDS = ("extractive", "open-ended")
NOTES = [
    "tokens/s: generated tokens over the wall time from the first request's start to the "
    "last one's end, per batch (median over batches); x: over generate's on the same "
    "model (int8 / int4 systems: generate's on that model).",
    "TTLT: call to last token (median over requests). same: greedy tokens equal to "
    "generate's on the same model; llama.cpp runs the GGUF the model ships (quantized "
    "weights: SmolLM2's Q4_1, Qwen's Q4_K_M / Q8_0), so it is not compared token for token.",
]


def base_of(system: str) -> str:
    """The ``generate`` of the same model as ``system``: engines over a model with int8 or
    int4 weights are named with it last ("ours, warm balanced, int8")."""
    weights = system.rsplit(", ", 1)[-1]
    return f"{BASE}, {weights}" if weights in WEIGHTS else BASE


def _tokens(request: dict[str, Any]) -> int:
    return request["tokens"] if request.get("ids") is None else len(request["ids"])


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # the peers' runs come after the engines': every system of a cell in one block
    keys = sorted(
        dict.fromkeys((r["length"], r["kind"], r["level"], r["system"]) for r in runs),
        key=lambda k: (k[0], KINDS.index(k[1]) if k[1] in KINDS else len(KINDS), k[2]),
    )
    base_ids = {
        (r["system"], r["length"], r["kind"], r["level"], r["batch"]): [
            q.get("ids") for q in r["requests"]
        ]
        for r in runs
        if r["system"] == base_of(r["system"])
    }
    out = []
    for length, kind, level, system in keys:
        group = [
            r
            for r in runs
            if (r["length"], r["kind"], r["level"], r["system"]) == (length, kind, level, system)
        ]
        rates, ttlt, ttft, same, compared = [], [], [], 0, 0
        for run in group:
            requests = run["requests"]
            begin = min(q["start"] for q in requests)
            end = max(q["start"] + q["ttlt"] / 1e3 for q in requests)
            rates.append(sum(map(_tokens, requests)) / max(end - begin, 1e-9))
            ttlt += [q["ttlt"] for q in requests]
            ttft += [q["ttft"] for q in requests]
            want = base_ids.get((base_of(system), length, kind, level, run["batch"]), [])
            for q, w in zip(requests, want):
                if q.get("ids") is not None:
                    compared += 1
                    same += q["ids"] == w
        out.append(
            {
                "length": length,
                "kind": kind,
                "level": level,
                "system": system,
                "requests": len(ttlt),
                "tokens_per_s": median(rates),
                "ttlt_ms": median(ttlt),
                "ttft_ms": median(ttft),
                "same": same,
                "compared": compared,
            }
        )
    for line in out:
        base = next(
            (
                b
                for b in out
                if (b["length"], b["kind"], b["level"], b["system"])
                == (line["length"], line["kind"], line["level"], base_of(line["system"]))
            ),
            None,
        )
        line["x"] = line["tokens_per_s"] / base["tokens_per_s"] if base else None
        line["ttlt_x"] = base["ttlt_ms"] / line["ttlt_ms"] if base and line["ttlt_ms"] else None
    return out


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"{report['model']} {m['dtype']} on {m['cpu']} ({m['cpu_count']} cores, "
        f"{m['threads']} threads), torch {m['torch']}, transformers {m['transformers']}",
        f"command: {report['command']}",
        "peers: "
        + ", ".join(
            f"{k} {'run' if v else 'not run (no environment given)'}"
            for k, v in report["peers_run"].items()
        ),
        *(f"failed: {name}: {why[-160:]}" for name, why in report.get("peers_failed", {}).items()),
    ]
    step = report.get("compiled_step")
    if step:
        times = step["ms_compiled_eager"]
        said = f", warm-up step {times[0]:.1f} against {times[1]:.1f} ms eager" if times else ""
        lines.append(
            f"compiled step: {step['state']} (compiled in {step['compile_s']:.0f} s{said})"
        )
    head = f"{'system':<30}{'tokens/s':>9}{'x':>7}{'TTLT ms':>10}{'x':>7}{'TTFT ms':>9}{'same':>8}"
    current = None
    for line in report["summary"]:
        key = (line["length"], line["kind"], line["level"])
        if key != current:
            current = key
            lines += ["", f"{line['length']} tokens, {line['kind']}, {line['level']} at once", head]
        same = f"{line['same']}/{line['compared']}" if line["compared"] else "-"
        lines.append(
            f"{line['system']:<30}{line['tokens_per_s']:>9.1f}{_x(line['x'])}{line['ttlt_ms']:>10.0f}"
            f"{_x(line['ttlt_x'])}{line['ttft_ms']:>9.0f}{same:>8}"
        )
    return "\n".join([*lines, "", *NOTES])


def _x(value: float | None) -> str:
    return f"{value:>7.2f}" if value is not None else f"{'-':>7}"


def draw(report: dict[str, Any], path: Path) -> Path:
    """Tokens/s per system, one group per (length, kind, concurrency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("the chart needs: pip install 'kvboost-rag[examples]'") from err
    summary = report["summary"]
    groups = list(dict.fromkeys((s["length"], s["kind"], s["level"]) for s in summary))
    names = list(dict.fromkeys(s["system"] for s in summary))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [
            next(
                (
                    s["tokens_per_s"]
                    for s in summary
                    if (s["length"], s["kind"], s["level"], s["system"]) == (*g, name)
                ),
                0,
            )
            for g in groups
        ]
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=name)
    ax.set_xticks(
        [g + 0.4 - width / 2 for g in range(len(groups))],
        [f"{n} tok\n{k}\nx{c}" for n, k, c in groups],
    )
    ax.set_ylabel("generated tokens/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return save(fig, report, path)
