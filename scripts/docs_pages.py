"""The generated parts of the README and the documentation site, rendered from their sources.

    .venv/bin/python scripts/docs_pages.py          # rewrite every generated section
    .venv/bin/python scripts/docs_pages.py --check  # exit 1 naming the sections that drifted

A generated section lies between ``<!-- NAME: start -->`` and ``<!-- NAME: end -->`` lines
of a page; NAME is its source: a benchmark's JSON under ``docs/bench/`` (rendered by that
benchmark's own report function), a recorded text file there (shown as it is), or
``KVBoostConfig`` (every field of ``core/config.py`` with the comment above it).
``tests/docs/test_pages.py`` checks that every page equals its rendering, so a table cannot
drift from the measurement or the code it shows. After a benchmark rewrites its JSON, run
this script.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling renderers
sys.path.insert(0, str(ROOT))  # the studies in benchmarks/ render their own tables

from fidelity_tables import levels_table, workloads_table  # noqa: E402


def _json(name: str) -> dict[str, Any]:
    return json.loads((BENCH / name).read_text())  # type: ignore[no-any-return]


def _text_block(name: str) -> str:
    return "```text\n" + (BENCH / name).read_text().rstrip() + "\n```"


QWEN_LATENCY = "latency-qwen2.5-coder-1.5b-instruct-bfloat16.json"  # the README's headline


def headline(name: str) -> Callable[[], str]:
    def render() -> str:
        from kvboost_rag.bench.latency.report import headline as table

        return table(_json(name))

    return render


def latency_table(name: str) -> str:
    from kvboost_rag.bench.latency.report import summarize, table

    report = _json(name)
    report["summary"] = summarize(report["rows"])  # a record from before a column was added
    return "```text\n" + table(report) + "\n```"


def bench_suite() -> str:
    from benchmarks.suite.report import bench_markdown

    return bench_markdown(_json("bench.json"), "bench.png")


def langchain() -> str:
    from benchmarks.rag.langchain_rag import table

    return table(_json("langchain-float32.json"))


def llamaindex() -> str:
    from benchmarks.rag.llamaindex_rag import table

    return table(_json("llamaindex.json"))


def load() -> str:
    from kvboost_rag.bench.load.report import table

    return table(_json("load-float32.json"))


def agent(framework: str) -> Callable[[], str]:
    """The step table of one framework's agent run (without the JSON summary line)."""

    def render() -> str:
        from benchmarks.agent.run import table

        text = table(_json("agent.json"))
        start = text.index("| step", text.index(f"## {framework}"))
        return text[start : text.index('{"steps"', start)].strip()

    return render


def chat(dtype: str) -> Callable[[], str]:
    def render() -> str:
        from benchmarks.suite.report import chat_table

        return chat_table(_json(f"chat-{dtype}.json")).strip()

    return render


def text_file(name: str) -> Callable[[], str]:
    return lambda: _text_block(name)


def config_fields() -> str:
    """Every ``KVBoostConfig`` field: its type, its default and the comment above it in
    ``core/config.py``, then the comments of the named choices the fields refer to."""
    from kvboost_rag.core.config import KVBoostConfig

    source = (ROOT / "core" / "config.py").read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVBoostConfig")
    defaults = {f.name: f for f in dataclasses.fields(KVBoostConfig)}
    from kvboost_rag.core.config import EXPERT_FIELDS

    header = ["| field | type | default | meaning |", "|---|---|---|---|"]
    everyday, expert = list(header), list(header)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            assert name in defaults, name
            (expert if name in EXPERT_FIELDS else everyday).append(
                f"| `{name}` | {_type(node.annotation)} | {_default(node, defaults[name])} | "
                f"{_cell(_comment_above(lines, node.lineno))} |"
            )
    listed = {r.split("`")[1] for r in everyday[2:] + expert[2:]}
    assert listed == set(defaults), f"fields without a row: {set(defaults) - listed}"
    assert EXPERT_FIELDS <= listed, f"EXPERT_FIELDS names no field: {EXPERT_FIELDS - listed}"
    rows = [
        *everyday,
        "",
        f"**Expert settings** ({len(expert) - 2} fields, `EXPERT_FIELDS`): tuned defaults, "
        "each measured on the models the project names; leave them unless a measurement on "
        "your model says otherwise.",
        "",
        *expert,
    ]
    named = (ROOT / "core" / "choices.py").read_text()  # the choices' own module
    named_lines = named.splitlines()
    choices = [
        f"- `{n.targets[0].id}` = `{ast.unparse(n.value)}`: {_comment_above(named_lines, n.lineno)}"
        for n in ast.parse(named).body
        if isinstance(n, ast.Assign)
        and isinstance(n.targets[0], ast.Name)
        and n.targets[0].id in ("Fidelity", "PassagePrefix", "PrefixFallback")
    ]
    from kvboost_rag.core.choices import FIDELITY_REPAIR

    levels = [
        "| level | repair | recompute_ratio | edge_tokens | probe_layers |",
        "|---|---|---|---|---|",
    ]
    levels += ["| `exact` | no passage reuse, no repair | - | - | - |"]
    levels += [
        f"| `{level}` | `{s.strategy}` | {s.recompute_ratio} | {s.edge_tokens} | "
        f"{'all' if s.probe_layers is None else s.probe_layers} |"
        for level, s in FIDELITY_REPAIR.items()
    ]
    return "\n".join(
        [
            *rows,
            "",
            "The named choices:",
            "",
            *choices,
            "",
            "What each level repairs when `repair`, `recompute_ratio`, `edge_tokens` and "
            "`probe_layers` are None (`FIDELITY_REPAIR`; only the level's strategy reads "
            "its knobs):",
            "",
            *levels,
        ]
    )


def _type(annotation: ast.expr) -> str:
    """``str | None`` as "`str` or `None`": a pipe would split the table's cell."""
    return " or ".join(f"`{part.strip()}`" for part in ast.unparse(annotation).split("|"))


def _default(node: ast.AnnAssign, spec: dataclasses.Field[Any]) -> str:
    value = node.value
    assert value is not None, "every field has a default"
    if isinstance(value, ast.Call):  # field(default=..., repr=False)
        value = next(k.value for k in value.keywords if k.arg == "default")
    text = f"`{ast.unparse(value)}`"
    if isinstance(spec.default, int) and spec.name.endswith("_bytes"):
        text += f" ({spec.default / 1024**3:g} GiB)"
    return text


def _comment_above(lines: list[str], lineno: int) -> str:
    """The run of ``#`` lines right above line ``lineno`` (1-based), as one paragraph."""
    out: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        out.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    assert out, f"line {lineno} of core/config.py has no comment above it"
    return " ".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def recorded_texts() -> dict[str, tuple[tuple[str, ...], Callable[[], str]]]:
    """A section named after a text file (``<!-- NAME.txt: start -->``, on README.md or a
    page under docs/) holds the recorded table of ``docs/bench/NAME.txt`` as it is: found
    on the pages, so a new record needs no entry here."""
    holders: dict[str, list[str]] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for name in re.findall(r"^<!-- (\S+\.txt): start -->$", text, re.MULTILINE):
            if not (BENCH / name).is_file():
                raise ValueError(f"{path.relative_to(ROOT)} shows docs/bench/{name}: no such file")
            holders.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return {name: (tuple(pages), text_file(name)) for name, pages in holders.items()}


# section name -> (the pages holding it, its rendering)
SECTIONS: dict[str, tuple[tuple[str, ...], Callable[[], str]]] = {
    f"{QWEN_LATENCY} headline": (
        ("README.md", "docs/index.md", "docs/bench/latency.md"),
        headline(QWEN_LATENCY),
    ),
    QWEN_LATENCY: (("docs/bench/latency.md",), lambda: latency_table(QWEN_LATENCY)),
    "latency-float32.json headline": (("docs/bench/latency.md",), headline("latency-float32.json")),
    "latency-bfloat16.json headline": (
        ("docs/bench/latency.md",),
        headline("latency-bfloat16.json"),
    ),
    "bench.json": (("docs/bench/suite.md",), bench_suite),
    "langchain-float32.json": (("docs/bench/langchain.md",), langchain),
    "llamaindex.json": (("docs/bench/llamaindex.md",), llamaindex),
    "load-float32.json": (("docs/bench/load.md",), load),
    "agent.json langchain": (("docs/bench/agents.md",), agent("langchain")),
    "agent.json llamaindex": (("docs/bench/agents.md",), agent("llamaindex")),
    "chat-float32.json": (("docs/bench/chat.md",), chat("float32")),
    "chat-bfloat16.json": (("docs/bench/chat.md",), chat("bfloat16")),
    "KVBoostConfig": (("docs/guides/configuration.md",), config_fields),
    "fidelity levels": (("README.md", "docs/guides/fidelity.md"), levels_table),
    "fidelity workloads": (
        ("docs/guides/fidelity.md", "docs/bench/fidelity.md"),
        workloads_table,
    ),
    **recorded_texts(),
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: start -->", f"<!-- {name}: end -->"


def rendered(text: str, name: str, body: str, page: str) -> str:
    """``text`` with section ``name`` replaced by ``body``."""
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"{page} needs one {start!r} and one {end!r} line")
    head, rest = text.split(start)
    return f"{head}{start}\n{body}\n{end}{rest.split(end)[1]}"


def pages() -> dict[str, str]:
    """Every page holding a generated section, as it should read."""
    out: dict[str, str] = {}
    for name, (holders, render) in SECTIONS.items():
        body = render()
        for page in holders:
            text = out.get(page) or (ROOT / page).read_text(encoding="utf-8")
            out[page] = rendered(text, name, body, page)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on drift")
    args = parser.parse_args(argv)
    drifted = []
    for page, text in pages().items():
        path = ROOT / page
        if path.read_text(encoding="utf-8") == text:
            continue
        drifted.append(page)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            print(f"updated {page}")
    if args.check and drifted:
        sys.exit(f"generated sections out of date in {', '.join(drifted)}: run {__file__}")


if __name__ == "__main__":
    main()
