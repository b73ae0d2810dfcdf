"""pytest imports test files by their base name (no package ``__init__`` in tests/), so two
test files of one name in different folders stop the whole run at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)
    twice = sorted(n for n, count in names.items() if count > 1 and n != "conftest.py")
    assert not twice, f"more than one file named {twice} under tests/"
