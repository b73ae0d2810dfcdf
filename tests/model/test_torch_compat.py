"""The private torch ops are called from ``torch_compat`` alone, on the range they were tested
on; torch stays unbounded in the package's dependencies, and a torch without one of the ops
takes the public path with a warning, or is refused for a choice that has none."""

import re
from pathlib import Path

import pytest
import tomllib
import torch
from packaging.version import Version

from kvboost_rag.core.model import packed, quantized, torch_compat

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
PRIVATE_OPS = re.compile(r"torch\.ops\.(mkldnn|onednn|quantized|aten\._)")


def test_the_installed_torch_is_in_the_tested_range() -> None:
    assert torch_compat.version_supported(torch.__version__)


def test_the_dependency_is_unbounded_from_below_the_tested_range() -> None:
    """Not pinned as transformers is: a torch without an op degrades (tests below)."""
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (requirement,) = [d for d in deps if re.match(r"torch\b", d)]
    lowest = re.fullmatch(r"torch>=([\d.]+)", requirement)
    assert lowest, f"{requirement!r}: a lower bound only, see core/model/torch_compat.py"
    assert Version(lowest[1]) <= torch_compat.TESTED[0]


def test_versions_outside_the_range_are_refused() -> None:
    assert not torch_compat.version_supported("2.12.1")
    assert not torch_compat.version_supported("2.14.0")
    assert torch_compat.version_supported("2.13.0+cpu")
    assert torch_compat.tested_range() == "torch>=2.13,<2.14"


def test_every_op_is_in_the_installed_torch() -> None:
    assert torch_compat.missing(*torch_compat.OPS) == []


def test_only_torch_compat_calls_private_torch_ops() -> None:
    callers = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "core").rglob("*.py")
        if PRIVATE_OPS.search(path.read_text()) and path.name != "torch_compat.py"
    )
    assert callers == []
    assert PRIVATE_OPS.search((ROOT / "core" / "model" / "torch_compat.py").read_text())


@pytest.fixture
def without_packed_linear(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A torch that lacks ``mkldnn._linear_pointwise``: the warnings ``usable`` gives."""
    said: list[str] = []
    monkeypatch.setattr(torch_compat, "_has", lambda op: op != "mkldnn._linear_pointwise")
    monkeypatch.setattr(torch_compat, "_warn_once", said.append)
    return said


def test_a_missing_op_takes_the_public_path_and_says_so(without_packed_linear: list[str]) -> None:
    assert torch_compat.missing(*torch_compat.OPS) == ["mkldnn._linear_pointwise"]
    if torch.backends.mkldnn.is_available():
        assert not packed.packs_dtype(torch.float32)
        (message,) = without_packed_linear
        assert "torch.ops.mkldnn._linear_pointwise" in message and "F.linear instead" in message
        assert torch.__version__ in message and "torch>=2.13,<2.14" in message


def test_a_choice_without_a_public_path_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_compat, "_has", lambda op: op != "aten._weight_int4pack_mm_for_cpu")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"weights='int4'.*_weight_int4pack_mm_for_cpu.*2\.14"):
        quantized.check_weights("int4", cpu)
    assert quantized.check_weights("int8", cpu) == "int8"
