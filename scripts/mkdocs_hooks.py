"""MkDocs hook (mkdocs.yml ``hooks:``): lay the package out as it installs, for the API
reference.

``core/`` and ``integrations/`` ship as ``kvboost_rag.core`` / ``kvboost_rag.integrations``
through ``[tool.setuptools.package-dir]``; griffe, which reads the sources for
mkdocstrings, finds packages by folder and does not follow that mapping. So this hook
builds ``build/api-sources/kvboost_rag/``: links to every entry of ``kvboost_rag/`` plus
``core`` and ``integrations``, the tree a wheel installs, and mkdocs.yml points
mkdocstrings there. It runs when the hook is imported, before any page is rendered.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "api-sources"
# The subpackages pyproject.toml maps from other folders (tests/docs/test_site.py checks).
MAPPED = {"core": "core", "integrations": "integrations"}


def lay_out() -> Path:
    package = TREE / "kvboost_rag"
    shutil.rmtree(TREE, ignore_errors=True)
    package.mkdir(parents=True)
    for entry in (ROOT / "kvboost_rag").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        (package / name).symlink_to(ROOT / folder, target_is_directory=True)
    return TREE


lay_out()
