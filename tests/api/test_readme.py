"""The README: every code block runs as written (on the embedded model) or says why not, it
stays a short first page, and its links lead somewhere. Its measured table is generated and
checked with the site's pages (tests/docs/test_pages.py)."""

from __future__ import annotations

import re

import pytest
from code_blocks import ROOT, blocks, markers, run_python

README = ROOT / "README.md"
BLOCKS = blocks("README.md")
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.not_run is None]


@pytest.mark.embedded
@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_readme_python_block_runs(block, request, monkeypatch, tmp_path) -> None:
    run_python(block, request, monkeypatch, tmp_path)


def test_every_readme_block_runs_or_says_why() -> None:
    unmarked = [b.name for b in BLOCKS if b.lang != "python" and b.not_run is None]
    assert not unmarked, f"shell or other blocks with no '<!-- not run: why -->': {unmarked}"
    assert all(b.not_run for b in BLOCKS if b.not_run is not None), "a marker without a reason"
    assert markers("README.md") == sum(b.not_run is not None for b in BLOCKS), (
        "a not-run marker that is not on the line right above a block"
    )


def test_readme_shows_both_frameworks_and_warming() -> None:
    code = "\n".join(b.code for b in PYTHON)
    for name in ("integrations.langchain", "integrations.llamaindex", "warm_corpus("):
        assert name in code, f"no README example runs {name}"


def test_readme_is_a_short_first_page() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 350, f"README.md is {lines} lines; move detail to docs/guides/"


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README.read_text()


def test_readme_links_lead_to_files_and_sections() -> None:
    """The README is not part of the site's strict build, so its links are checked here."""
    slugify = pytest.importorskip("markdown.extensions.toc", reason="needs the dev extra").slugify
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links to no guide"
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {path}, which is not there"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), flags=re.M)
            slugs = {slugify(h.strip(), "-") for h in headings}
            assert anchor in slugs, f"README links to {link}: no such heading in {path}"
