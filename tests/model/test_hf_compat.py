"""The private transformers calls are used on the range they were tested on, and the
package's dependency pin says the same range."""

import re
from pathlib import Path

import tomllib
import transformers

from kvboost_rag.core.model import hf_compat

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_installed_transformers_is_in_the_tested_range() -> None:
    assert hf_compat.version_supported(transformers.__version__)


def test_the_dependency_pin_is_the_tested_range() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"transformers\b", d)]
    low, high = hf_compat.TESTED
    assert pin == f"transformers>={low},<{high}"


def test_versions_outside_the_range_are_refused() -> None:
    assert not hf_compat.version_supported("5.23.1")
    assert not hf_compat.version_supported("5.25.0")
    assert hf_compat.version_supported("5.24.2")
