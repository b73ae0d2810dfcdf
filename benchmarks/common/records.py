"""A study's record: its report as JSON and its table as text, side by side under ``out``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_record(out: Path, name: str, report: dict[str, Any], text: str) -> None:
    """``out/<name>.json`` (the report) and ``out/<name>.txt`` (the printed table)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.txt").write_text(text + "\n")
