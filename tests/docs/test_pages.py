"""The generated sections of the README and the site equal their rendering from the
benchmarks' JSON and from ``KVBoostConfig`` (scripts/docs_pages.py), so no table drifts."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from code_blocks import ROOT

from kvboost_rag import KVBoostConfig
from kvboost_rag.core.config import EXPERT_FIELDS


def _docs_pages():
    spec = importlib.util.spec_from_file_location("docs_pages", ROOT / "scripts" / "docs_pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_pages = _docs_pages()


def test_check_finds_every_generated_section_up_to_date() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs_pages.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", sorted(docs_pages.SECTIONS))
def test_section_on_its_pages_equals_its_rendering(name: str) -> None:
    holders, render = docs_pages.SECTIONS[name]
    start, end = docs_pages.markers(name)
    body = render()
    for page in holders:
        text = (ROOT / page).read_text(encoding="utf-8")
        assert f"{start}\n{body}\n{end}" in text, f"{page}: section {name!r} drifted"


def test_check_fails_naming_the_page_that_drifted(tmp_path: Path, monkeypatch) -> None:
    for page in {p for holders, _ in docs_pages.SECTIONS.values() for p in holders}:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    shutil.copytree(ROOT / "docs" / "bench", tmp_path / "docs" / "bench", dirs_exist_ok=True)
    (tmp_path / "core").mkdir()
    for source in ("config.py", "choices.py"):  # the fields and the named choices
        shutil.copy(ROOT / "core" / source, tmp_path / "core" / source)
    load = tmp_path / "docs" / "bench" / "load.md"
    # the batched N=1 row's tokens/s, whatever the recorded run measured
    edited = re.sub(r"(\| batched \| 1 \| )[0-9.]+", r"\g<1>999.9", load.read_text(), count=1)
    assert edited != load.read_text()
    load.write_text(edited)  # one cell edited by hand
    monkeypatch.setattr(docs_pages, "ROOT", tmp_path)
    monkeypatch.setattr(docs_pages, "BENCH", tmp_path / "docs" / "bench")
    with pytest.raises(SystemExit, match="docs/bench/load.md"):
        docs_pages.main(["--check"])
    docs_pages.main([])  # rewrites it
    docs_pages.main(["--check"])


def test_rendered_needs_both_markers_once() -> None:
    with pytest.raises(ValueError, match="needs one"):
        docs_pages.rendered("<!-- x: start -->\nno end", "x", "body", "page.md")
    out = docs_pages.rendered("a\n<!-- x: start -->\nold\n<!-- x: end -->\nb", "x", "new", "p")
    assert out == "a\n<!-- x: start -->\nnew\n<!-- x: end -->\nb"


def _config_rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "guides" / "configuration.md").read_text(encoding="utf-8")
    start, end = docs_pages.markers("KVBoostConfig")
    section = text.split(start)[1].split(end)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", match.group(2))]
    return rows


def test_configuration_page_lists_every_field_in_order_everyday_then_expert() -> None:
    fields = [f.name for f in dataclasses.fields(KVBoostConfig)]
    ordered = [n for n in fields if n not in EXPERT_FIELDS] + [
        n for n in fields if n in EXPERT_FIELDS
    ]
    rows = _config_rows()
    assert [name for name in rows if name in fields] == ordered
    assert EXPERT_FIELDS < set(fields)


def test_configuration_page_defaults_are_the_class_defaults() -> None:
    rows = _config_rows()
    for spec in dataclasses.fields(KVBoostConfig):
        default = rows[spec.name][1].split("`")[1]  # `2 * 1024 ** 3` (2 GiB)
        assert eval(default, {}) == spec.default, spec.name  # noqa: S307 (our own source)
        assert rows[spec.name][2], f"{spec.name} has no meaning on the page"


def test_a_recorded_text_is_found_on_its_page_and_a_missing_one_named(
    tmp_path: Path, monkeypatch
) -> None:
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# x\n")
    page = tmp_path / "docs" / "bench" / "new.md"
    page.write_text("<!-- run-a.txt: start -->\n<!-- run-a.txt: end -->\n")
    (tmp_path / "docs" / "bench" / "run-a.txt").write_text("col  value\nrow  1.0\n")
    monkeypatch.setattr(docs_pages, "ROOT", tmp_path)
    monkeypatch.setattr(docs_pages, "BENCH", tmp_path / "docs" / "bench")
    found = docs_pages.recorded_texts()
    assert list(found) == ["run-a.txt"]
    holders, render = found["run-a.txt"]
    assert holders == ("docs/bench/new.md",)
    assert render() == "```text\ncol  value\nrow  1.0\n```"
    page.write_text(page.read_text() + "<!-- run-b.txt: start -->\n<!-- run-b.txt: end -->\n")
    with pytest.raises(ValueError, match="docs/bench/new.md shows docs/bench/run-b.txt: no such"):
        docs_pages.recorded_texts()
