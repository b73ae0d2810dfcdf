"""Type-check the package as it is installed: ``kvboost_rag.core`` and
``kvboost_rag.integrations`` live in the top-level ``core/`` and ``integrations/`` folders
(pyproject's package-dir), which mypy cannot follow, so ``mypy kvboost_rag core`` typed
every ``kvboost_rag.core`` import as Any. This lays the package out as installed, in a
folder of links, and checks it there (and ``benchmarks/``, which imports it).

    .venv/bin/python scripts/typecheck.py   # exit status: mypy's
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"core": ROOT / "core", "integrations": ROOT / "integrations"}  # package-dir


def main(files: list[str] | None = None) -> int:
    """mypy's exit status over the package and ``benchmarks/`` (or over ``files``, which
    import the package as installed)."""
    with tempfile.TemporaryDirectory(prefix="kvboost-typecheck-") as folder:
        tree = Path(folder)
        package = tree / "kvboost_rag"
        package.mkdir()
        for item in (ROOT / "kvboost_rag").iterdir():
            if item.name != "__pycache__":
                (package / item.name).symlink_to(item)
        for name, target in MAPPED.items():
            (package / name).symlink_to(target)
        packages = ["-p", "kvboost_rag"]
        if (ROOT / "benchmarks").is_dir():
            (tree / "benchmarks").symlink_to(ROOT / "benchmarks")
            packages += ["-p", "benchmarks"]
        command = [
            sys.executable, "-m", "mypy",
            "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(ROOT / ".mypy_cache"),
            *(files or packages),
        ]  # fmt: skip
        return subprocess.run(command, cwd=tree).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or None))
