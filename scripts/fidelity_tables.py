"""The fidelity levels as the README and the fidelity guide show them (rendered by
``docs_pages.py``): what each level reuses and recomputes, in words whose numbers are read
from ``KVBoostConfig``'s defaults (``FIDELITY_REPAIR``, the shared repair's run length), and
what it kept and how much sooner it answered, read from the recorded real-model front
(``docs/bench/front-real-*.json``) for the benchmark option that runs the level's settings
as they are now. A level whose settings no record measured is an error, not a stale
number: change a default, rerun the benchmark (issue 48: ``balanced`` was described as
"the 30% of its tokens the question attends to most" in three places, as 25% by value
deviation in others, and was neither)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
RECORDS = {  # model label -> its front record
    "1.5B": "front-real-qwen2.5-coder-1.5b-instruct-bfloat16.json",
    "0.5B": "front-real-qwen2.5-coder-0.5b-instruct-bfloat16.json",
}
HEADLINE = "1.5B"  # the model the levels table quotes

# What each repair strategy recomputes, in words; {settings} fields are filled from code.
REPAIRS: dict[str, Callable[[Any, int], str]] = {
    "none": lambda s, run: "nothing, each passage's KV is used as it was encoded",
    "shared": lambda s, run: (
        f"every sentence of a passage holding {run} tokens in a row that another passage "
        f"of the prompt holds, and each passage's first {s.edge_tokens} tokens; past "
        f"{s.recompute_ratio:.0%} of the reused tokens, all of them"
    ),
    "deviation": lambda s, run: (
        f"the {s.recompute_ratio:.0%} of reused tokens whose values at layer "
        f"{(s.probe_layers or 2) - 1} moved most"
    ),
}
# Options the front measured beside the levels, as the tables name them.
NOTES = {"prompt+deviation r=0.25": "`deviation` 25%, `balanced` before"}
PICK = {
    "exact": "answers must equal the model's own",
    "balanced": "passages move between prompts",
    "fast": "time to first token matters most",
}


def description(level: str) -> str:
    """What ``level`` reuses and recomputes, from its settings in ``core/config.py``."""
    from kvboost_rag.core.config import KVBoostConfig
    from kvboost_rag.core.reuse.shared import SHARED_RUN

    settings = KVBoostConfig(fidelity=level).repair_settings()  # type: ignore[arg-type]
    if settings is None:
        return "exact prefixes only (system prompt, template, chat history, agent steps)"
    repair = REPAIRS[settings.strategy](settings, SHARED_RUN)
    return (
        "exact prefixes, and every passage at any position, encoded after the prompt's own "
        f"prefix; the `{settings.strategy}` repair recomputes {repair}"
    )


def measured_option(options: Mapping[str, Mapping[str, Any]], level: str) -> str:
    """The front option whose config runs ``level``'s settings as they are now."""
    from kvboost_rag.core.config import KVBoostConfig

    wanted = _effect(KVBoostConfig(fidelity=level))  # type: ignore[arg-type]
    found = [name for name, kwargs in options.items() if _effect(KVBoostConfig(**kwargs)) == wanted]
    if not found:
        raise ValueError(
            f"no front option measures fidelity={level!r} as it is now ({wanted}): rerun "
            "`python -m benchmarks.front --systems real` and record it under docs/bench"
        )
    return found[0]


def _effect(config: Any) -> tuple[Any, ...]:
    return (config.fidelity == "exact", config.repair_settings(), config.passage_prefix)


def levels_table() -> str:
    """One row per level: what it reuses and recomputes, what it kept, when to pick it."""
    from benchmarks.front.options import OPTIONS
    from kvboost_rag.core.config import FIDELITY_LEVELS, KVBoostConfig

    report = _record(HEADLINE)
    rows = [
        f"| level | reuses, and recomputes | on Qwen2.5-Coder-{HEADLINE} | pick it when |",
        "|---|---|---|---|",
    ]
    for level in FIDELITY_LEVELS:
        total = report["totals"][measured_option(_measured(report, OPTIONS), level)]
        kept, of = total["kept"]
        default = " (default)" if level == KVBoostConfig().fidelity else ""
        same = "identical to full prefill's (tested in fp32); " if level == "exact" else ""
        rows.append(
            f"| `{level}`{default} | {description(level)} | {same}kept {kept} of full "
            f"prefill's {of} right answers at {total['ttft_speedup']:.2f}x its TTFT | "
            f"{PICK[level]} |"
        )
    return "\n".join(rows)


def workloads_table() -> str:
    """Per model and option, over the recorded workloads: answers kept, the TTFT speed-up
    (geometric mean, and the range over workloads) and the TTLT speed-up."""
    from benchmarks.front.options import OPTIONS
    from kvboost_rag.core.config import FIDELITY_LEVELS

    rows = [
        "| model | option | kept of full prefill's right answers | TTFT speed-up | TTLT speed-up |",
        "|---|---|---|---|---|",
    ]
    for model in RECORDS:
        report = _record(model)
        levels = {measured_option(_measured(report, OPTIONS), lv): lv for lv in FIDELITY_LEVELS}
        others = [option for option in report["options"] if option not in levels]
        for option in [*levels, *others]:
            total = report["totals"][option]
            rows.append(
                f"| {model} | {_label(option, levels)} | {total['kept'][0]}/{total['kept'][1]} "
                f"| {_speedup(report, option, total['ttft_speedup'], levels)} | "
                f"{total['ttlt_speedup']:.2f}x |"
            )
    return "\n".join(rows)


def _label(option: str, levels: Mapping[str, str]) -> str:
    if option not in levels:
        return NOTES.get(option, f"`{option}`")
    level = levels[option]
    strategy = option.split("+")[1].split()[0] if "+" in option else None
    return f"`{level}`" + (f" (`{strategy}`)" if strategy else "")


def _speedup(report: dict[str, Any], option: str, mean: float, levels: Mapping[str, str]) -> str:
    text = f"{mean:.2f}x"
    if levels.get(option) in ("balanced", "fast"):
        cells = [c["systems"][option]["speedup"] for c in report["cells"].values()]
        text += f" ({min(cells):.1f}-{max(cells):.1f}x)"
    return text


def _measured(report: dict[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    return {name: options[name] for name in report["options"] if name in options}


def _record(model: str) -> dict[str, Any]:
    return json.loads((BENCH / RECORDS[model]).read_text())  # type: ignore[no-any-return]
