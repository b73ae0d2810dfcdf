"""The benchmark pages answer one question each with their current run (issue 51), and every
``docs/bench/...`` path the code and the docs cite is still there: records stay at their
paths because comments in core/ and the guides name them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from code_blocks import ROOT, blocks

BENCH = ROOT / "docs" / "bench"
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in BENCH.glob("*.md"))
QUESTIONS = [p for p in PAGES if Path(p).stem not in ("index", "history")]
# Where a citation may be written; the records' own headers (their command lines) are not.
CITING = ["core", "kvboost_rag", "integrations", "scripts", "tests", "benchmarks", "docs"]
SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh"}
CITED = re.compile(r"docs/bench/[\w.*{},<>-]+")
PLACEHOLDERS = ("<", "{name}", "NAME")  # docs/bench/latency-<dtype>.json, docs/bench/NAME.txt
# Names tests/docs/test_pages.py writes into a temporary tree of its own.
FIXTURES = {"docs/bench/new.md", "docs/bench/run-b.txt"}


def citing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "mkdocs.yml"]
    for folder in CITING:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    return files


def expand(cited: str) -> list[str]:
    """``cluster.{txt,json}`` as two names; anything else as it is."""
    braces = re.search(r"\{([^}]*,[^}]*)\}", cited)
    if not braces:
        return [cited]
    return [cited[: braces.start()] + part + cited[braces.end() :] for part in braces[1].split(",")]


def exists(cited: str) -> bool:
    """A name, a glob (``constants-*``) or, without a suffix, a prefix (``--out`` stems)."""
    name = cited.removeprefix("docs/bench/")
    if "*" in name or "." not in name:
        return any(BENCH.glob(name if "*" in name else f"{name}*"))
    return (BENCH / name).exists()


def citations() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in citing_files():
        for cited in CITED.findall(path.read_text(encoding="utf-8", errors="replace")):
            cited = cited.rstrip(".,")
            if any(p in cited for p in PLACEHOLDERS) or cited in FIXTURES:
                continue
            for name in expand(cited):
                found.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    return found


def test_every_cited_record_exists() -> None:
    found = citations()
    assert len(found) > 20, "the scan found too few citations to mean anything"
    missing = {name: sorted(set(where)) for name, where in found.items() if not exists(name)}
    assert not missing, f"cited but not in docs/bench/: {missing}"


def test_a_missing_record_is_found() -> None:
    assert exists("docs/bench/constants-*") and exists("docs/bench/prefill-floor")
    gone = "docs/bench/" + "no-such"  # split, so that the scan above does not cite it
    assert not exists(f"{gone}-record.txt") and not exists(f"{gone}-*") and not exists(gone)
    assert expand("docs/bench/cluster.{txt,json}") == [
        "docs/bench/cluster.txt",
        "docs/bench/cluster.json",
    ]


@pytest.mark.parametrize("page", QUESTIONS)
def test_a_page_opens_with_its_question_answer_command_machine_and_date(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    title = text.splitlines()[0]
    assert title.startswith("# ") and title.endswith("?"), f"{page}: {title!r} is no question"
    top = text[: text.find("\n## ")] if "\n## " in text else text
    assert "**Answer.**" in top, f"{page} does not answer above its first section"
    for row in (r"\| commands? \|", r"\| machines? \|", r"\| dates? \|.*20\d\d-\d\d-\d\d"):
        assert re.search(row, top), f"{page} has no {row} row above its first section"
    assert len(text.splitlines()) < 300, f"{page} is a notebook again: move runs to history.md"


def test_the_index_lists_every_page() -> None:
    index = (BENCH / "index.md").read_text(encoding="utf-8")
    for page in PAGES:
        name = Path(page).name
        assert name == "index.md" or f"]({name})" in index, f"index.md does not link {name}"


@pytest.mark.parametrize("page", PAGES)
def test_every_command_block_says_why_it_does_not_run(page: str) -> None:
    """Blocks shown inside a generated section (a record's text) are the record's own."""
    text = (ROOT / page).read_text(encoding="utf-8")
    generated = [
        (text.count("\n", 0, m.start()) + 1, text.count("\n", 0, m.end()) + 1)
        for m in re.finditer(r"^<!-- (.+?): start -->$.*?^<!-- \1: end -->$", text, re.S | re.M)
    ]
    unmarked = [
        b.name
        for b in blocks(page)
        if b.lang != "text" and b.not_run is None and not any(a < b.line < z for a, z in generated)
    ]
    assert not unmarked, f"blocks with no '<!-- not run: why -->' above them: {unmarked}"
