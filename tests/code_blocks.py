"""The fenced code blocks of the README and the guides, for the tests that run them.

Every block runs in the tests unless the line right above its fence says why it does not,
as ``<!-- not run: REASON -->`` (an HTML comment: neither GitHub nor the site shows it).
Python blocks run on the embedded model; a block naming ``REDIS_URL`` or
``REDIS_CLUSTER_URL`` gets a private server or cluster of the tests' own
(``tests/redis_server.py``). A shell block has to be marked: setup, benchmark and
command-synopsis lines are what they are. A block's comment ``# prints: "A", "B"`` names
text its output must hold (the answers the example shows are checked, not only run).
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.*?) -->")
PRINTS = re.compile(r"#\s*prints:\s*(.+)$", re.M)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason, when the block is marked not to run

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def prints(self) -> list[str]:
        """What its ``# prints: "A", "B"`` comments say its output holds."""
        return [
            text for found in PRINTS.findall(self.code) for text in re.findall(r'"([^"]+)"', found)
        ]


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page``, with the not-run reason of the line above it."""
    text = (ROOT / page).read_text(encoding="utf-8")
    out = []
    for match in FENCE.finditer(text):
        above = text[: max(match.start() - 1, 0)].rsplit("\n", 1)[-1]  # the line above
        marker = NOT_RUN.fullmatch(above.strip())
        line = text.count("\n", 0, match.start()) + 1
        reason = marker.group(1).strip() if marker else None
        out.append(Block(page, line, match.group(1), match.group(2), reason))
    return out


def markers(page: str) -> int:
    """How many not-run markers ``page`` holds (each must sit right above a block)."""
    return len(NOT_RUN.findall((ROOT / page).read_text(encoding="utf-8")))


def run_python(block: Block, request: pytest.FixtureRequest, monkeypatch, tmp_path) -> None:
    """Run ``block`` as a script would, offline, in an empty working folder."""
    assert block.lang == "python" and block.not_run is None, block.name
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the embedded model and MiniLM are local
    monkeypatch.chdir(tmp_path)
    if "REDIS_URL" in block.code:  # the shared-tier recipes: a private redis-server
        monkeypatch.setenv("REDIS_URL", request.getfixturevalue("redis_server").url)
    if "REDIS_CLUSTER_URL" in block.code:  # the cluster recipe: a private 3-master cluster
        monkeypatch.setenv("REDIS_CLUSTER_URL", request.getfixturevalue("redis_cluster").url)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})
    print(output.getvalue(), end="")
    missing = [text for text in block.prints if text not in output.getvalue()]
    assert not missing, f"{block.name} printed no {missing}:\n{output.getvalue()}"
