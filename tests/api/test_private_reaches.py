"""The benchmarks read the engine through its public API and ``KVBoost.inspect``
(``core/inspection.py``), never through another object's private attributes: every
``x._name`` in ``benchmarks/`` and ``kvboost_rag/bench/`` where ``x`` is not ``self`` or
``cls`` fails here, unless it is a third party's and listed below. Read from the source
(``ast``), nothing imported: one study runs on import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
FOLDERS = [ROOT / "benchmarks", ROOT / "kvboost_rag" / "bench"]
# Third parties' private names, each with why it is read.
ALLOWED = {
    # torch's compiler: its recompile limit and counters (benchmarks/decode/step.py).
    "torch._dynamo",
    # the `kvboost` package measured side by side: its passage encoder, timed on its own
    # (kvboost_rag/bench/common/peer.py).
    "self._peer._encode",
}


def reaches(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue  # dunders (__class__, __doc__) are Python's, not private
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        text = ast.unparse(node)
        if text not in ALLOWED:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    return found


def test_benchmarks_reach_no_private_attribute() -> None:
    files = sorted(p for folder in FOLDERS for p in folder.rglob("*.py"))
    assert len(files) > 50  # both folders were read
    assert [hit for path in files for hit in reaches(path)] == []


def test_the_rule_finds_a_reach_and_passes_the_rest(tmp_path: Path) -> None:
    source = "engine._prompts.text(x)\nself._own = 1\nengine.__class__\ntorch._dynamo.reset()\n"
    path = tmp_path / "study.py"
    path.write_text(source)
    assert reaches(path, tmp_path) == ["study.py:1: engine._prompts"]
