"""``kvboost-rag serve``'s command line: bad usage is one line on stderr and exit status 2,
found before any model loads (so before the server would start)."""

from __future__ import annotations

from typing import Any

import pytest
from cli_run import run

import kvboost_rag.core.model.stored_weights as loading_module
from kvboost_rag.cli.serve import API_KEY_VARIABLE


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Models loaded: none may be, for a command line that is refused."""
    loaded: list[Any] = []
    monkeypatch.setattr(loading_module, "load_model", lambda *a, **k: loaded.append(a))
    return loaded


@pytest.mark.parametrize(
    "flags",
    [
        ["--port", "70000"],
        ["--port", "http"],
        ["--request-timeout", "0"],
        ["--request-timeout", "nan"],
        ["--max-queue", "0"],
        ["--max-answers", "0"],
        ["--max-body-bytes", "-5"],
        ["--dtype", "int3"],
        ["--weights", "int2"],
        ["--fidelity", "perfect"],
        ["--bogus"],
        ["/no/such/model/folder"],
        ["--served-model-name", ""],
    ],
)
def test_bad_usage_is_one_line_and_loads_nothing(flags, capsys, loads) -> None:
    status, out, err = run(["serve", *flags], capsys)
    assert status == 2, (flags, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("kvboost-rag")
    assert ": error: " in err
    assert "Traceback" not in err
    assert loads == []


def test_a_blank_key_in_the_environment_is_bad_usage(capsys, loads, monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_VARIABLE, "   ")
    status, _, err = run(["serve"], capsys)
    assert status == 2 and "api_key is blank" in err
    assert loads == []


def test_help_names_the_flags_and_the_key_variable(capsys) -> None:
    status, out, _ = run(["serve", "--help"], capsys)
    assert status == 0
    for text in ("--host", "--port", "--api-key", "--dtype", API_KEY_VARIABLE):
        assert text in out
