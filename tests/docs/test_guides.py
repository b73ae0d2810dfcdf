"""Every code block of the site's home page and guides runs as written (on the embedded
model; Redis recipes on the tests' private servers), or says on the line above it why not."""

from __future__ import annotations

import pytest
from code_blocks import ROOT, blocks, markers, run_python

PAGES = [
    "docs/index.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "guides").glob("*.md")),
]
BLOCKS = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.not_run is None]


@pytest.mark.embedded
@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_guide_python_block_runs(block, request, monkeypatch, tmp_path) -> None:
    run_python(block, request, monkeypatch, tmp_path)


def test_every_block_that_prints_names_what_it_prints() -> None:
    """An example is checked for its answer, not only run (issue 48: agents.md's examples
    ran and printed '<tool_response> 84 </tool_response>' as the answer)."""
    readme = [b for b in blocks("README.md") if b.lang == "python" and b.not_run is None]
    silent = [b.name for b in [*PYTHON, *readme] if "print(" in b.code and not b.prints]
    assert not silent, f"blocks that print with no '# prints: \"...\"' comment: {silent}"


def test_every_guide_block_runs_or_says_why() -> None:
    unmarked = [b.name for b in BLOCKS if b.lang != "python" and b.not_run is None]
    assert not unmarked, f"shell or other blocks with no '<!-- not run: why -->': {unmarked}"
    assert all(b.not_run for b in BLOCKS if b.not_run is not None), "a marker without a reason"


@pytest.mark.parametrize("page", PAGES)
def test_not_run_markers_sit_above_a_block(page: str) -> None:
    assert markers(page) == sum(b.not_run is not None for b in blocks(page)), (
        f"{page} has a not-run marker that is not on the line right above a block"
    )


def test_the_guides_named_in_the_issue_are_there() -> None:
    guides = {p.split("/")[-1] for p in PAGES}
    for name in (
        "langchain",
        "llamaindex",
        "agents",
        "storage",
        "serving",
        "fidelity",
        "configuration",
        "models",
        "troubleshooting",
    ):
        assert f"{name}.md" in guides, name


def test_the_models_guide_opens_with_every_way_to_name_a_model() -> None:
    """A new user read its first paragraph and found neither GGUF files nor the Qwen
    aliases, which only server.md and `serve --help` named (issue 64)."""
    from kvboost_rag.core.model.embedded import EMBEDDED_MODELS

    opening = (ROOT / "docs/guides/models.md").read_text(encoding="utf-8").split("\n## ")[0]
    named = [f'`"{alias}"`' for alias in EMBEDDED_MODELS] + ["GGUF file", "gguf_file="]
    named += ["`kvboost-rag convert FILE.gguf --out DIR`", "`kvboost-rag models`"]
    assert [name for name in named if name not in opening] == []
