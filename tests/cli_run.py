"""Running ``kvboost-rag`` in the test's own process, for the CLI tests."""

from __future__ import annotations

import pytest

from kvboost_rag.cli.main import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``kvboost-rag argv``, in this process: its exit status, stdout and stderr."""
    try:
        main(argv)
        status = 0
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err
