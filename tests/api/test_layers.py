"""Imports point one way. ``core``'s folders (and its top-level modules) form layers, each
importing only from layers below it (or itself), and ``core`` imports nothing of the
package around it (``kvboost_rag``'s CLI, server, benchmarks; ``integrations``). Read from
the source (every ``import``, lazy and type-only ones too), so an arrow back up fails here
before it becomes a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
CORE = ROOT / "core"
# Lowest first. A unit is a folder of core/ or a module at its top.
LAYERS: list[set[str]] = [
    {"errors", "caller_warnings", "field_types", "remote_url", "choices"},
    {"config"},
    {"model"},
    {"store"},
    {"tools"},
    {"prompt"},
    {"results"},
    {"reuse"},
    {"generation"},
    {"requests", "warming", "inspection"},
    {"retry"},  # a request's answer, decoded again as text where it must be (over requests)
    {"engine"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def unit_of(path: Path) -> str:
    parts = path.relative_to(CORE).parts
    return parts[0] if len(parts) > 1 else path.stem


def imports(path: Path) -> list[str]:
    """Every module ``path`` imports (absolute ``from`` and plain imports)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def arrows() -> list[tuple[str, str, str]]:
    """(importing file, its unit, the imported core unit) for every import of core."""
    out = []
    for path in sorted(CORE.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == CORE:
            continue
        for module in imports(path):
            if module.startswith("kvboost_rag.core."):
                out.append((str(path.relative_to(ROOT)), unit_of(path), module.split(".")[2]))
            elif module.startswith(("kvboost_rag", "integrations")):
                out.append((str(path.relative_to(ROOT)), unit_of(path), module))
    return out


def test_every_unit_of_core_has_a_layer() -> None:
    units = {unit_of(p) for p in CORE.rglob("*.py") if p.parent != CORE or p.stem != "__init__"}
    assert units == set(RANK), (units - set(RANK), set(RANK) - units)


def test_core_imports_only_downward_and_nothing_above_it() -> None:
    upward = [
        f"{path} ({unit}) imports {target}"
        for path, unit, target in arrows()
        if target not in RANK or RANK[target] > RANK[unit]
    ]
    assert upward == []


def test_a_unit_of_one_layer_does_not_import_another_of_the_same() -> None:
    sideways = [
        f"{path} imports {target}"
        for path, unit, target in arrows()
        if target in RANK and target != unit and RANK[target] == RANK[unit]
    ]
    assert sideways == []


def test_the_package_never_imports_the_studies() -> None:
    """``benchmarks/`` is not in the wheel: nothing of the package (``kvboost_rag`` with its
    ``bench``, ``core``, ``integrations``) may import it, lazily or not."""
    sources = [ROOT / "kvboost_rag", CORE, ROOT / "integrations"]
    found = [
        f"{path.relative_to(ROOT)} imports {module}"
        for folder in sources
        for path in sorted(folder.rglob("*.py"))
        for module in imports(path)
        if module == "benchmarks" or module.startswith("benchmarks.")
    ]
    assert found == []


PACKAGE = ROOT / "kvboost_rag"
# The package's top: the public API (``__init__``, ``warm_corpus`` and what a document is)
# and the essay corpus (``kvboost_rag.essays``, which the examples and the engine guide
# name). The command's modules are in ``kvboost_rag/cli/``.
TOP = {"__init__", "documents", "essays", "warm"}


def test_the_commands_modules_are_in_cli() -> None:
    assert {p.stem for p in PACKAGE.glob("*.py")} == TOP


def test_nothing_below_the_command_imports_it() -> None:
    """The engine, the adapters, the server and the public API never import ``kvboost_rag.cli``
    (the benchmark workloads, which ``kvboost-rag bench`` runs, take its arguments)."""
    below = [CORE, ROOT / "integrations", PACKAGE / "serve"]
    files = [p for folder in below for p in folder.rglob("*.py")]
    files += [PACKAGE / f"{name}.py" for name in TOP]
    found = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(files)
        for module in imports(path)
        if module == "kvboost_rag.cli" or module.startswith("kvboost_rag.cli.")
    ]
    assert found == []
