"""The documentation site builds with ``mkdocs build --strict``: no broken link or anchor,
no page left out of the nav, every API reference resolves (mkdocs.yml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from code_blocks import ROOT

pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra: bash scripts/setup.sh")
yaml = pytest.importorskip("yaml", reason="mkdocs brings PyYAML")


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)]
    return subprocess.run(
        [*command, "-d", str(site)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # no end-of-life banner
    )


def test_site_builds_strict(tmp_path: Path) -> None:
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    for page in _pages(nav):
        folder = Path(page).parent if Path(page).stem == "index" else Path(page).with_suffix("")
        html = tmp_path / "site" / folder / "index.html"
        assert html.is_file(), f"{page} was not built"
    reference = (tmp_path / "site" / "reference" / "engine" / "index.html").read_text()
    for name in ("KVBoostConfig", "warm_corpus", "GenerationResult", "generate"):
        assert name in reference, f"the API reference does not document {name}"


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """The strict build is what catches a link to a section that is not there."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    home = docs / "index.md"
    home.write_text(home.read_text() + "\n[gone](guides/engine.md#no-such-section)\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(ROOT / hook) for hook in config["hooks"]]
    python = next(p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict))
    python = python["handlers"]["python"]
    python["paths"] = [str(ROOT / path) for path in python["paths"]]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-section" in done.stdout + done.stderr


def test_the_reference_reads_the_package_as_it_installs() -> None:
    """scripts/mkdocs_hooks.py maps the folders pyproject.toml maps into kvboost_rag."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from mkdocs_hooks import MAPPED
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {
        name.removeprefix("kvboost_rag."): folder
        for name, folder in dirs["package-dir"].items()
        if name.count(".") == 1
    }
    assert mapped == MAPPED


def _pages(nav: list) -> list[str]:
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _pages(value) if isinstance(value, list) else [value]
    return out
