"""The summary, table and chart of ``bench.decode``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvboost_rag.bench.common.chart import save
from kvboost_rag.bench.common.metrics import median
from kvboost_rag.core.model.quantized import WEIGHTS

BASE = "generate"
KINDS = ("extractive", "open-ended")
# The systems given the physical limit: our step without drafts (each weights kind) and
# llama.cpp's; drafts verify several tokens a step, which a per-token floor does not bound.
FLOOR_SYSTEM, PEER = "ours, no drafts", "llama.cpp"
NOTES = [
    "tokens/s: generated tokens over the wall time from the first request's start to the "
    "last one's end, per batch (median over batches); x: over generate's on the same "
    "model (systems named with a weights kind, e.g. int4, gguf: generate's on that model).",
    "TTLT: call to last token (median over requests). same: greedy tokens equal to "
    "generate's on the same model; llama.cpp runs the GGUF the model ships (quantized "
    "weights: SmolLM2's Q4_1, Qwen's Q4_K_M / Q8_0), so it is not compared token for token.",
    "ms/tok: (TTLT - TTFT) / (tokens - 1), median over requests, one at a time. floor: the "
    "bytes a step reads over the read bandwidth this run measured (ours: the weights our "
    "step reads, lm_head included, one row of the embeddings; llama.cpp: its GGUF file's "
    "size); x floor: ms/tok over floor.",
]


def base_of(system: str) -> str:
    """The ``generate`` of the same model as ``system``: engines over a model stored as one
    of ``WEIGHTS`` are named with it last ("ours, warm balanced, int8", "ours, gguf")."""
    weights = system.rsplit(", ", 1)[-1]
    return f"{BASE}, {weights}" if weights in WEIGHTS else BASE


def floor_bytes(system: str, floor: dict[str, Any]) -> int | None:
    """The bytes one step of ``system`` reads (``floor``: the report's), for the systems
    the floor is given for; None for the others."""
    if system == PEER:
        return floor.get("gguf_bytes")  # type: ignore[no-any-return]
    head, _, weights = system.rpartition(", ")
    if system == FLOOR_SYSTEM or (head == FLOOR_SYSTEM and weights in WEIGHTS):
        kind = "checkpoint" if system == FLOOR_SYSTEM else weights
        return floor["step_bytes"].get(kind)  # type: ignore[no-any-return]
    return None


def add_floor(summary: list[dict[str, Any]], floor: dict[str, Any]) -> None:
    """Give ``summary``'s lines of one request at a time the floor under their ms per token:
    the bytes a step reads (``step_bytes``), over the bandwidth (``floor_ms``), and the
    measured ms per token over it (``floor_x``)."""
    for line in summary:
        nbytes = floor_bytes(line["system"], floor) if line["level"] == 1 else None
        floor_ms = nbytes / (floor["read_gb_per_s"] * 1e6) if nbytes else None
        measured = line.get("ms_per_token")
        line["step_bytes"], line["floor_ms"] = nbytes, floor_ms
        line["floor_x"] = measured / floor_ms if floor_ms and measured else None


def _tokens(request: dict[str, Any]) -> int:
    return request["tokens"] if request.get("ids") is None else len(request["ids"])


def _ms_per_token(request: dict[str, Any]) -> float | None:
    """The decoding steps' time per token: after the first token, over the tokens after it."""
    tokens = _tokens(request)
    return (request["ttlt"] - request["ttft"]) / (tokens - 1) if tokens > 1 else None


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
        rates, ttlt, ttft, per_token, same, compared = [], [], [], [], 0, 0
        for run in group:
            requests = run["requests"]
            begin = min(q["start"] for q in requests)
            end = max(q["start"] + q["ttlt"] / 1e3 for q in requests)
            rates.append(sum(map(_tokens, requests)) / max(end - begin, 1e-9))
            ttlt += [q["ttlt"] for q in requests]
            ttft += [q["ttft"] for q in requests]
            per_token += [t for t in map(_ms_per_token, requests) if t is not None]
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
                # one request at a time: a step's time, not shared with others
                "ms_per_token": median(per_token) if level == 1 and per_token else None,
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
    floor = report.get("floor")
    if floor:
        lines.append(_floor_line(floor))
    head = f"{'system':<30}{'tokens/s':>9}{'x':>7}{'TTLT ms':>10}{'x':>7}{'TTFT ms':>9}{'same':>8}"
    head += f"{'ms/tok':>8}{'floor':>7}{'x floor':>8}"
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
            f"{_number(line.get('ms_per_token'), 8, 1)}{_number(line.get('floor_ms'), 7, 1)}"
            f"{_number(line.get('floor_x'), 8, 2)}"
        )
    return "\n".join([*lines, "", *NOTES])


def _x(value: float | None) -> str:
    return f"{value:>7.2f}" if value is not None else f"{'-':>7}"


def _number(value: float | None, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def _floor_line(floor: dict[str, Any]) -> str:
    """The bandwidth and the bytes the floors divide by it."""
    reads = [f"{kind} {n / 1e6:.0f} MB" for kind, n in floor["step_bytes"].items()]
    if floor.get("gguf_bytes"):
        reads.append(f"llama.cpp's GGUF {floor['gguf_bytes'] / 1e6:.0f} MB")
    return (
        f"read bandwidth {floor['read_gb_per_s']:.1f} GB/s (torch.sum over "
        f"{floor['buffer_bytes'] / 2**30:.1f} GiB, best of {floor['passes']}); a step "
        f"reads: {', '.join(reads)}"
    )


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
