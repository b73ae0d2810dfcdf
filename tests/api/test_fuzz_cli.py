"""Property-based fuzzing (hypothesis) of the ``kvboost-rag`` command, run in this process
through ``kvboost_rag.cli.main``: for any command line built from every subcommand and
flag (values valid, wrong, missing, of the wrong kind), the exit status is the one the
command line calls for (2 for bad usage, 1 for a failure, 0 otherwise), a non-zero status
comes with exactly one error line on stderr, nothing raises out of ``main`` (no traceback),
and bad usage loads no model. ``warm`` runs for real on the tiny random Llama saved as a
model folder; ``demo`` and ``bench`` only ever get command lines that must be refused
(benchmarks are not run in tests). Examples per property: 40 always; 2,000 under the
``slow`` marker (HYPOTHESIS_PROFILE=thorough)."""

from __future__ import annotations

import io
import shutil
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import run_thorough
from hypothesis import event, given
from hypothesis import strategies as st

import kvboost_rag.core.model.stored_weights as loading_module
from kvboost_rag.cli.main import BENCHES, main

USAGE, FAILED = 2, 1
NOTE = "Note {i}: item {i} costs {i} dollars."
# Drawn uniformly: hypothesis leans to small integers, so integers(0, 9) == 0 is not 1 in 10.
ONE_IN_TEN = st.sampled_from([False] * 9 + [True])
WORDS = st.text("abcdefghij .,:\n", min_size=1, max_size=20)
BLANK = st.text(" \t\n", max_size=3)


def run(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)``'s status, stdout and stderr; anything else it raises fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(argv)
            status = 0
        except SystemExit as exit:
            assert isinstance(exit.code, int), f"exit with {exit.code!r}"
            status = exit.code
    return status, out.getvalue(), err.getvalue()


def check_output(status: int, out: str, err: str, argv: list[str]) -> None:
    """One error line for a non-zero status, none otherwise; nothing else but warnings and
    the progress bar on stderr."""
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == (1 if status else 0), (argv, status, err)
    assert "Traceback" not in err and "UserWarning" not in err, (argv, err)
    if status == USAGE:
        assert out == "" and err.count("\n") == 1, (argv, out, err)


@pytest.fixture(scope="module")
def loads(tiny_model_dir: str) -> list[str]:
    """The models loaded (their paths), counted: bad usage must load none."""
    loaded: list[str] = []
    real = loading_module.load_model

    def counted(path: str, *args: Any, **kwargs: Any) -> Any:
        loaded.append(path)
        return real(path, *args, **kwargs)

    loading_module.load_model = counted  # type: ignore[assignment]
    yield loaded
    loading_module.load_model = real  # type: ignore[assignment]


# -- warm ----------------------------------------------------------------------------------

GOOD_FILE = st.integers(0, 9).map(lambda i: NOTE.format(i=i).encode())
BAD_FILE = st.sampled_from([b"", b"  \n", "Caf\xe9".encode("latin-1")])


@dataclass
class Warm:
    """One ``warm`` command line and what its parts call for."""

    files: list[tuple[str, bytes]]  # name -> content, in the folder
    folder: str = "notes"  # "notes", "missing" or "a-file"
    cache_dir: str | None = "cache"  # "cache", "a-file", "under-a-file", "unmakeable" or None
    remote_url: str | None = None
    options: list[str] = field(default_factory=list)
    usage: bool = False  # a part that is bad usage
    strict: bool = False
    glob: str = "*.txt"

    def argv(self, root: Path, model: str) -> list[str]:
        folder = {"notes": root / "notes", "missing": root / "no-such", "a-file": root / "f"}
        argv = ["warm", str(folder[self.folder])]
        caches = {
            "cache": root / "cache",
            "a-file": root / "f",
            "under-a-file": root / "f" / "kv",
            "unmakeable": Path("/proc/no-such-process/kv"),
        }
        if self.cache_dir is not None:
            argv += ["--cache-dir", str(caches[self.cache_dir])]
        if self.remote_url is not None:
            argv += ["--remote-url", self.remote_url]
        argv += ["--glob", self.glob] + (["--strict"] if self.strict else [])
        options = [model if o == "<model>" else o for o in self.options]
        return argv + (["--model", model] if "--model" not in options else []) + options

    def expected(self) -> int:
        if self.usage or self.folder != "notes" or self.cache_dir not in ("cache", None):
            return USAGE
        if self.cache_dir is None and self.remote_url is None:
            return USAGE
        if self.remote_url is not None and not self.remote_url.startswith("redis://"):
            return USAGE
        matched = [c for n, c in self.files if n.endswith(".txt") or self.glob == "*"]
        if not matched:
            return USAGE
        readable = [c for c in matched if _text(c)]
        if (self.strict and len(readable) < len(matched)) or not readable:
            return FAILED
        return FAILED if self.remote_url is not None else 0  # nothing listens there


def _text(content: bytes) -> bool:
    try:
        return bool(content.decode("utf-8").strip())
    except UnicodeDecodeError:
        return False


# Each option: values that are fine, and values that are bad usage.
WARM_OPTIONS: dict[str, tuple[list[str], list[str]]] = {
    "--dtype": (["float32", "bfloat16"], ["fp32", "float16x", "int8", ""]),
    "--fidelity": (["balanced", "fast"], ["exact", "Fast"]),
    "--kv-codec": (["none", "int8", "fp8"], ["zip", ""]),
    "--remote-namespace": (["kvboost", "team-a"], ["", "a b"]),
    "--model": (["<model>"], ["/no/such/model", "", "no-such-alias", "./missing"]),
}


@st.composite
def warm_commands(draw: st.DrawFn) -> Warm:
    names = draw(
        st.lists(st.sampled_from(["a.txt", "b.txt", "c.txt", "d.md"]), min_size=1, unique=True)
    )
    files = [(n, draw(GOOD_FILE | GOOD_FILE | GOOD_FILE | BAD_FILE)) for n in names]
    case = Warm(files, strict=draw(st.booleans()), glob=draw(st.sampled_from(["*.txt", "*"])))
    case.folder = draw(st.sampled_from(["notes"] * 12 + ["missing", "a-file"]))
    case.cache_dir = draw(
        st.sampled_from(["cache"] * 12 + [None, "a-file", "under-a-file", "unmakeable"])
    )
    case.remote_url = draw(
        st.sampled_from([None] * 12 + ["redis://127.0.0.1:1", "http://127.0.0.1:6379", ""])
    )
    for option, (good, bad) in WARM_OPTIONS.items():
        if draw(st.booleans()):
            wrong = draw(ONE_IN_TEN)
            case.options += [option, draw(st.sampled_from(bad if wrong else good))]
            case.usage |= wrong
    layout = draw(st.sampled_from(["", "", "--prefix", "--prefix", "--system", "both"]))
    if layout == "both":
        case.options += ["--prefix", "a", "--system", "b"]
        case.usage = True
    elif layout:
        marker = st.just("\u27e6kvboost:passage\u27e7")
        case.options += [layout, draw(WORDS | WORDS | WORDS | BLANK | marker)]
        case.usage |= "\u27e6" in case.options[-1]  # a stray marker: no layout
    if draw(ONE_IN_TEN) and draw(st.booleans()):
        case.options.append(draw(st.sampled_from(["--bogus", "--strict=yes", "-x"])))
        case.usage = True
    return case


@given(case=warm_commands())
def test_warm_exits_as_its_command_line_calls_for(tiny_model_dir: str, loads, case: Warm) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvboost-cli-"))
    try:
        (root / "notes").mkdir()
        (root / "f").write_text("a file, not a folder")
        for name, content in case.files:
            (root / "notes" / name).write_bytes(content)
        argv = case.argv(root, tiny_model_dir)
        before = len(loads)
        status, out, err = run(argv)
        event(f"status {status}")
        assert status == case.expected(), (argv, status, out, err)
        check_output(status, out, err, argv)
        if status == USAGE:
            assert len(loads) == before, argv  # refused before any model loaded
        if status == 0:
            assert out.startswith("warmed ") and "disk:" in out or case.cache_dir is None
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- demo: only command lines to refuse (a valid one runs the whole demo) -------------------

DEMO_OPTIONS: dict[str, tuple[list[str], list[str]]] = {
    "--chunks": (["1", "12"], ["0", "-3", "many", "1.5", ""]),
    "--chunk-tokens": (["64", "200"], ["0", "-1", "x"]),
    "--questions": (["1", "4"], ["0", "5", "99", "two"]),
    "--max-new-tokens": (["1", "40"], ["0", "-1", "ten"]),
    "--dtype": (["float32", "bfloat16"], ["fp32", "float16x", "int8"]),
    "--model": ([], ["/no/such/model", "", "smollm9", "./missing"]),
}


@st.composite
def demo_commands(draw: st.DrawFn) -> list[str]:
    argv, wrong = ["demo"], False
    for option, (good, bad) in DEMO_OPTIONS.items():
        use_bad = not good or draw(ONE_IN_TEN)
        if draw(st.booleans()) or (option == "--model" and not wrong):
            argv += [option, draw(st.sampled_from(bad if use_bad else good))]
            wrong |= use_bad
    if not wrong or draw(ONE_IN_TEN):
        argv.append(draw(st.sampled_from(["--bogus", "extra", "--chunks"])))
    return argv


@given(argv=demo_commands())
def test_demo_refuses_bad_usage_in_one_line(loads, argv: list[str]) -> None:
    before = len(loads)
    status, out, err = run(argv)
    assert status == USAGE, (argv, status, out, err)
    check_output(status, out, err, argv)
    assert len(loads) == before


# -- bench: every workload's parser, always given something to refuse ---------------------

BENCH_FLAGS = [
    "--quick",
    "--out",
    "--dtype",
    "--model",
    "--chunks",
    "--repeats",
    "--max-new-tokens",
    "--max-tokens",
    "--queries",
    "--passages",
    "--threads",
    "--fidelity",
    "--seed",
    "--k",
]
BENCH_VALUES = ["0", "-1", "x", "float16x", "fast", "3", "out-folder"]


@st.composite
def bench_commands(draw: st.DrawFn) -> list[str]:
    workload = draw(st.sampled_from([*sorted(BENCHES), "nope"]) | st.none())
    argv = ["bench"] + ([workload] if workload else [])
    for _ in range(draw(st.integers(0, 4))):
        argv.append(draw(st.sampled_from(BENCH_FLAGS)))
        if draw(st.booleans()):
            argv.append(draw(st.sampled_from(BENCH_VALUES)))
    argv.insert(draw(st.integers(1, len(argv))), "--no-such-flag")
    return argv


@given(argv=bench_commands())
def test_bench_refuses_bad_usage_in_one_line(loads, argv: list[str]) -> None:
    before = len(loads)
    status, out, err = run(argv)
    assert status == USAGE, (argv, status, out, err)
    check_output(status, out, err, argv)
    assert len(loads) == before


# "serve" is a subcommand now (it would start a server); "start" is not one.
@given(argv=st.lists(st.sampled_from(["", "start", "--bogus", "-h=x", "warm=1", "x"]), max_size=2))
def test_top_level_bad_usage(argv: list[str]) -> None:
    status, out, err = run(argv)
    assert status == USAGE and out == "" and err.count("\n") == 1, (argv, err)


@pytest.mark.slow
def test_every_property_holds_over_2000_examples() -> None:
    run_thorough(__file__, 4)
