"""The package type-checks as it is installed (``scripts/typecheck.py``): mypy run on the
folders cannot follow pyproject's package-dir, so it typed every ``kvboost_rag.core``
import as Any and passed whatever the callers did with them."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")
ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_layout_type_checks() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "typecheck.py")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Success" in run.stdout


def test_the_check_sees_through_package_dir(tmp_path: Path) -> None:
    """A wrong argument to a ``kvboost_rag.core`` class is an error, not Any."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import typecheck
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    for value, status in (("'fast'", 0), ("3", 1)):
        probe = tmp_path / f"probe_{status}.py"
        probe.write_text(
            f"from kvboost_rag.core.config import KVBoostConfig\nKVBoostConfig(fidelity={value})\n"
        )
        assert typecheck.main([str(probe)]) == status, value
