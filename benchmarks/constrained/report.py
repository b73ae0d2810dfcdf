"""The constrained-decoding benchmark's summaries, tables and files (JSON and text)."""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.bench.common.metrics import median

PACKAGES = ("llguidance", "outlines-core", "lm-format-enforcer", "transformers", "torch")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    """The CPU's model name (``platform.processor()`` is empty on many Linux systems)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(engine: Any, load: list[float]) -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).replace("torch.", ""),
        "versions": {p: _version(p) for p in PACKAGES},
        "load_average_at_start": load,
    }


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def library_summary(row: dict[str, Any]) -> dict[str, Any]:
    targets = {name: _cell(cell) for name, cell in row["targets"].items()}
    return {"prepare_ms": row["prepare_ms"], "notes": row["notes"], "targets": targets}


def _cell(cell: dict[str, Any]) -> dict[str, Any]:
    if "error" in cell:
        return {"error": cell["error"]}
    runs = cell["runs"]
    base = median([r["base_ms"] / r["tokens"] for r in runs])
    overhead = median([(r["ms"] - r["base_ms"]) / r["tokens"] for r in runs])
    errors = [r["errors"] for r in runs if r["errors"]]
    return {
        "compile_ms": cell["compile_ms"],
        "request_setup_ms": median(cell["request_ms"]),
        "first_call_ms": median([r["first_call_ms"] for r in runs]),
        "call_ms": median([r["call_ms"] for r in runs]),
        "replay_call_ms": median([r["replay_ms"] for r in runs]),
        "tokens": median([r["tokens"] for r in runs]),
        "ms_per_token": median([r["ms"] / r["tokens"] for r in runs]),
        "unconstrained_ms_per_token": base,
        "overhead_ms_per_token": overhead,
        "overhead_pct": 100 * overhead / base,
        "valid_runs": len(runs) - len(errors),
        "runs": len(runs),
        "finished_runs": sum(r["finished"] for r in runs),
        "errors": errors[0] if errors else [],
        "sample": runs[0]["text"],
    }


def engine_summary(records: dict[str, dict[str, list]]) -> dict[str, Any]:
    return {
        name: {mode: _mode(rows) for mode, rows in modes.items()} for name, modes in records.items()
    }


def _mode(rows: list[dict[str, Any]]) -> dict[str, Any]:
    decoded = [r for r in rows if r["tokens"] > 1]
    return {
        "valid": sum(r["valid"] for r in rows),
        "tasks": len(rows),
        "valid_pct": 100 * sum(r["valid"] for r in rows) / len(rows),
        "valid_unfenced": sum(r["valid_unfenced"] for r in rows),
        "median_tokens": median([r["tokens"] for r in rows]),
        "ms_per_token": median([r["total_ms"] / r["tokens"] for r in rows]),
        "decode_ms_per_token": median([r["decode_ms"] / (r["tokens"] - 1) for r in decoded]),
        "median_ttft_ms": median([r["ttft_ms"] for r in rows]),
        "requests": rows,
    }


def lines(result: dict[str, Any]) -> list[str]:
    out = [
        f"{result['model']} {result['dtype']} on {result['cpu']} ({result['cpus']} CPUs, "
        f"torch threads {result['torch_threads']}); load average at start "
        f"{result['load_average_at_start']}, at end {result['load_average_at_end']}",
        "",
        f"Valid answers, engine.chat greedy, max_new_tokens {result['max_new_tokens']} "
        "(unfenced: unconstrained answers valid once a ``` fence is removed; per output "
        "token: total_ms / tokens; decode: after the first token)",
        f"{'task set':<13} {'unconstrained':>14} {'unfenced':>8} {'constrained':>12} "
        f"{'ms/tok off':>10} "
        f"{'on':>7} {'decode off':>10} {'on':>7} {'TTFT off':>8} {'on':>7}",
    ]
    for name, modes in result["engine"].items():
        off, on = modes["off"], modes["on"]
        out.append(
            f"{name:<13} {_rate(off):>14} {off['valid_unfenced']:>8} {_rate(on):>12} "
            f"{off['ms_per_token']:>10.1f} "
            f"{on['ms_per_token']:>7.1f} {off['decode_ms_per_token']:>10.1f} "
            f"{on['decode_ms_per_token']:>7.1f} {off['median_ttft_ms']:>8.0f} "
            f"{on['median_ttft_ms']:>7.0f}"
        )
    return out + _library_lines(result)


def _rate(mode: dict[str, Any]) -> str:
    return f"{mode['valid']}/{mode['tasks']} {mode['valid_pct']:.0f}%"


def _library_lines(result: dict[str, Any]) -> list[str]:
    out = [
        "",
        f"Libraries on model.generate, median of {result['repeats']} runs; plain = "
        "unconstrained generate forced to the same token count; mask = the processor's "
        "own ms per call, in generate / replayed without the model",
        f"{'library':<19} {'target':<21} {'tok':>4} {'valid':>5} {'ms/tok':>7} "
        f"{'plain':>7} {'overhead':>15} {'mask':>11} {'1st call':>8} {'prepare':>8} "
        f"{'compile':>8} {'request':>7}",
    ]
    for name, row in result["libraries"].items():
        for target, c in row["targets"].items():
            head = f"{name:<19} {target:<21}"
            if "error" in c:
                out.append(f"{head} FAILED: {c['error'][:200]}")
                continue
            out.append(
                f"{head} {c['tokens']:>4.0f} {c['valid_runs']:>2}/{c['runs']:<2} "
                f"{c['ms_per_token']:>7.1f} {c['unconstrained_ms_per_token']:>7.1f} "
                f"{c['overhead_ms_per_token']:>+7.2f} ({c['overhead_pct']:>+4.1f}%) "
                f"{c['call_ms']:>5.2f}/{c['replay_call_ms']:<5.2f} "
                f"{c['first_call_ms']:>8.1f} {row['prepare_ms']:>8.0f} "
                f"{c['compile_ms']:>8.1f} {c['request_setup_ms']:>7.2f}"
            )
    return out + _notes(result)


def _notes(result: dict[str, Any]) -> list[str]:
    out = []
    for name, row in result["libraries"].items():
        out += [f"{name}: {note}" for note in row.get("notes", [])]
        for target, c in row["targets"].items():
            if c.get("errors"):
                out.append(f"{name} / {target}: invalid output: {c['errors'][:3]}")
    return ["", *out] if out else []


def write(out: Path, result: dict[str, Any]) -> None:
    """Print the tables and write ``constrained.json`` and ``constrained.txt`` under ``out``."""
    result["load_average_at_end"] = load_average()
    text = "\n".join(lines(result))
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "constrained.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "constrained.txt").write_text(text + "\n")
    print(f"wrote {out / 'constrained.json'} and {out / 'constrained.txt'}")
