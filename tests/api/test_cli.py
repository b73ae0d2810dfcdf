import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run
from conftest import make_model, make_tokenizer

from kvboost_rag import KVBoost, KVBoostConfig, format_passages
from kvboost_rag.cli.main import BENCHES, STUDIES, main
from kvboost_rag.core.model.quantized import QuantizedLinear, quantize


@pytest.mark.embedded
def test_demo_answers_through_both_frameworks_with_timings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(
        [
            "demo",
            "--chunks",
            "12",
            "--chunk-tokens",
            "96",
            "--questions",
            "1",
            "--max-new-tokens",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert "warming 12 essay chunks" in out
    lines = [line for line in out.splitlines() if "full prefill (" in line]
    assert len(lines) == 2  # one LangChain and one LlamaIndex answer
    for line in lines:
        # Every chunk was warmed first: each prompt reads its passages (less the ~30% that
        # "balanced" recomputes) and its template prefix from cache.
        reused, prompt = map(int, line.split("reused ")[1].split(" ")[0].split("/"))
        assert reused > 0.4 * prompt
    # Warmed for the chain's prompt, which the query engine shares: every passage of both
    # frameworks' answers is read under the prompt's own prefix.
    passages = [line.strip() for line in out.splitlines() if "passages hit" in line]
    assert passages == ["passages hit 4 (0 foreign), missed 0"] * 2


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if ": error: " in line]


def test_unknown_subcommand_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(["start"], capsys)  # not a subcommand ("serve" is one now)
    assert status == 2 and "invalid choice" in err
    assert err.count("\n") == 1  # one line, not argparse's usage text and the message


def test_demo_and_cli_do_not_import_the_benchmarks() -> None:
    # A fresh interpreter: this test process may already have loaded kvboost_rag.bench.
    check = (
        "import sys, kvboost_rag.cli.main, kvboost_rag.cli.demo; "
        "bench = [m for m in sys.modules if m.startswith('kvboost_rag.bench')]; "
        "assert not bench, bench"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_bench_names_where_a_study_went(capsys: pytest.CaptureFixture[str]) -> None:
    """The package measures a machine and model (latency, load, warm); the studies are in
    the repository's benchmarks/ folder, and asking for one says how to run it there."""
    status, out, err = run(["bench", "front", "--quick"], capsys)
    assert (status, out) == (2, "") and err.count("\n") == 1
    assert err == (
        "kvboost-rag bench: error: front is a study in the repository's benchmarks/ folder, "
        "not in the package: from a clone run `python -m benchmarks.front`\n"
    )
    assert "`python -m benchmarks.decode.step`" in run(["bench", "step"], capsys)[2]
    assert "`python -m benchmarks.suite`" in run(["bench", "all"], capsys)[2]
    status, _, err = run(["bench"], capsys)  # no workload: the three there are
    assert status == 2 and "latency | load | warm" in err and err.count("\n") == 1
    root = Path(__file__).parents[2]
    for study, module in STUDIES.items():  # each hint names a study that is there
        path = root / "benchmarks" / Path(*module.split("."))
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), study
    assert set(BENCHES) == {"latency", "load", "warm"}


NOTES = [f"Note {i}: item {i} costs {i * 3} dollars." for i in range(3)]


@pytest.fixture
def tiny_engines(monkeypatch: pytest.MonkeyPatch) -> list[KVBoost]:
    """``warm`` loads a tiny random model instead of the embedded one; the engines it built."""
    built: list[KVBoost] = []

    def tiny(
        model: str, dtype: object = None, weights: str | None = None, config: object = None
    ) -> KVBoost:
        hf_model = make_model("llama")
        if weights is not None:
            quantize(hf_model, weights)
        built.append(KVBoost(hf_model, make_tokenizer(), config))  # type: ignore[arg-type]
        return built[-1]

    monkeypatch.setattr(KVBoost, "from_pretrained", tiny)
    return built


@pytest.mark.parametrize("flag", ["--prefix", "--system"])
def test_warm_folder_for_a_prompt_layout(
    tmp_path: Path, tiny_engines: list[KVBoost], capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    for i, note in enumerate(NOTES):
        (folder / f"{i}.txt").write_text(note + "\n")
    head = "Answer from these notes.\n" if flag == "--prefix" else "Answer from these notes."
    cache = tmp_path / "cache"
    main(["warm", str(folder), "--cache-dir", str(cache), "--fidelity", "fast", flag, head])
    assert "warmed 3 files into 3 passages" in capsys.readouterr().out
    engine = tiny_engines[0]
    if flag == "--prefix":
        result = engine.generate(head + format_passages(NOTES[::-1]) + "Which?")
    else:
        question = format_passages(NOTES[::-1]) + "Which?"
        result = engine.chat(
            [{"role": "system", "content": head}, {"role": "user", "content": question}]
        )
    # Every note is reused under the prompt's own prefix (none foreign, none encoded).
    assert (result.passages_hit, result.passages_foreign, result.passages_missed) == (3, 0, 0)


def test_warm_loads_the_weights_asked_for(
    tmp_path: Path, tiny_engines: list[KVBoost], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "0.txt").write_text(NOTES[0])
    main(["warm", str(folder), "--cache-dir", str(tmp_path / "cache"), "--weights", "int4"])
    assert "warmed 1 file into 1 passage " in capsys.readouterr().out
    layer = tiny_engines[0].model.model.layers[0].mlp.up_proj
    assert type(layer) is QuantizedLinear and layer.kind == "int4"


def test_warm_takes_one_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["warm", str(tmp_path), "--cache-dir", str(tmp_path), "--prefix", "a", "--system", "b"]
    status, _, err = run(argv, capsys)
    assert status == 2 and "not allowed with argument" in err


def test_warm_folder_into_redis_only(
    tmp_path: Path, tiny_engines: list[KVBoost], capsys: pytest.CaptureFixture[str], redis_server
) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    for i, note in enumerate(NOTES):
        (folder / f"{i}.txt").write_text(note + "\n")
    main(["warm", str(folder), "--remote-url", redis_server.url, "--kv-codec", "int8"])
    out = capsys.readouterr().out
    assert "warmed 3 files into 3 passages" in out and "3 values written" in out
    # A second machine (no disk, the default codec) decodes the int8 values it reads.
    reader = KVBoost(
        make_model("llama"), make_tokenizer(), KVBoostConfig(remote_url=redis_server.url)
    )
    result = reader.generate("Which?", passages=[n + "\n" for n in NOTES], max_new_tokens=1)
    assert (result.passages_hit + result.passages_unused, result.passages_missed) == (3, 0)  # found


def test_warm_needs_a_destination(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(["warm", str(tmp_path)], capsys)
    assert status == 2
    assert err == (
        "kvboost-rag warm: error: warm needs --cache-dir, --remote-url or both (where the KV "
        "goes), or --server\n"
    )


def notes_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "notes"
    folder.mkdir()
    for i, note in enumerate(NOTES):
        (folder / f"{i}.txt").write_text(note + "\n")
    return folder


def test_warm_skips_empty_and_non_utf8_files_with_a_warning_naming_each(
    tmp_path: Path, tiny_engines: list[KVBoost], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = notes_folder(tmp_path)
    (folder / "empty.txt").write_text("  \n")
    (folder / "latin1.txt").write_bytes("Caf\xe9 cr\xe8me".encode("latin-1"))
    status, out, err = run(["warm", str(folder), "--cache-dir", str(tmp_path / "cache")], capsys)
    assert status == 0
    warned = [line for line in err.splitlines() if line.startswith("kvboost-rag: warning: ")]
    assert any(line.endswith("empty.txt: it is empty") for line in warned), err
    assert any("latin1.txt: it is not UTF-8 text (byte 3" in line for line in warned), err
    # One line each: not Python's "file:line: UserWarning:" and the source line after it.
    assert "UserWarning" not in err and "warnings.warn(" not in err
    assert "warmed 3 files into 3 passages" in out and "skipped 2 files" in out
    strict = ["warm", str(folder), "--cache-dir", str(tmp_path / "cache"), "--strict"]
    status, _, err = run(strict, capsys)
    assert status == 1 and error_lines(err) == [
        f"kvboost-rag warm: error: {folder / 'empty.txt'}: it is empty"
    ]


# -- exit status and one line on stderr (issue 28, items 2, 7, 8) -------------------------


def test_warm_fails_when_the_shared_tier_stores_nothing(
    tmp_path: Path, tiny_engines: list[KVBoost], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = notes_folder(tmp_path)
    argv = ["warm", str(folder), "--remote-url", "redis://127.0.0.1:1"]  # nothing listens
    status, out, err = run(argv, capsys)
    assert "0 values written" in out and "1 errors" in out  # the report still says what it did
    assert status == 1
    (line,) = error_lines(err)
    assert line.startswith("kvboost-rag warm: error: the shared tier redis://127.0.0.1:1 failed")


def test_warm_fails_when_a_disk_write_fails(
    tmp_path: Path,
    tiny_engines: list[KVBoost],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvboost_rag.core.store import disk

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "_atomic_write", full)
    folder = notes_folder(tmp_path)
    status, _, err = run(["warm", str(folder), "--cache-dir", str(tmp_path / "cache")], capsys)
    assert status == 1
    (line,) = error_lines(err)
    assert "could not write" in line and "No space left on device" in line


def bad_usage(tmp_path: Path) -> list[list[str]]:
    """Command lines a new user gets wrong, each to be refused before any work."""
    folder = notes_folder(tmp_path)
    a_file = folder / "0.txt"
    cache = str(tmp_path / "cache")
    return [
        ["warm", str(folder), "--cache-dir", str(a_file)],
        ["warm", str(folder), "--cache-dir", str(a_file / "below")],
        ["warm", str(folder), "--cache-dir", "/proc/no-such-process/cache"],  # cannot be made
        ["demo", "--chunks", "0"],
        ["demo", "--max-new-tokens", "0"],
        ["demo", "--questions", "99"],
        ["demo", "--chunk-tokens", "many"],
        ["warm", str(folder), "--cache-dir", cache, "--dtype", "float16x"],
        ["demo", "--dtype", "fp32"],
        ["warm", str(tmp_path / "no" / "such" / "folder"), "--cache-dir", cache],
        ["warm", str(a_file), "--cache-dir", cache],
        ["warm", str(folder), "--cache-dir", cache, "--model", "/no/such/model"],
        ["warm", str(folder), "--cache-dir", cache, "--glob", "*.md"],
        ["warm", str(folder), "--remote-url", "http://127.0.0.1:6379"],
        ["warm", str(folder), "--cache-dir", cache, "--remote-namespace", "a b"],
        ["warm", str(folder), "--cache-dir", cache, "--fidelity", "exact"],
        ["warm", str(folder), "--cache-dir", cache, "--prefix", "\u27e6kvboost:passage\u27e7"],
        ["bench", "--no-such-option"],
        ["bench"],
        ["bench", "chat", "--repeats", "0"],
        ["bench", "latency", "--requests", "0"],
        ["bench", "load", "--dtype", "int8"],
        ["bench", "load", "--weights", "int2"],
        ["bench", "latency", "--weights", "q4_k_m"],
    ]


def test_bad_usage_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded for a command line that is wrong")

    monkeypatch.setattr("kvboost_rag.core.model.stored_weights.load_model", no_loading)
    for argv in bad_usage(tmp_path):
        status, out, err = run(argv, capsys)
        assert (status, out) == (2, ""), (argv, status, out, err)
        assert err.count("\n") == 1 and ": error: " in err, (argv, err)


def test_misleading_messages_name_what_was_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, err = run(["warm", str(tmp_path / "missing"), "--cache-dir", str(tmp_path)], capsys)
    assert f"no such folder: {tmp_path / 'missing'}" in err and "*.txt" not in err
    (tmp_path / "a.txt").write_text("x")
    _, _, err = run(["warm", str(tmp_path / "a.txt"), "--cache-dir", str(tmp_path)], capsys)
    assert "a.txt is a file, not a folder" in err
    _, _, err = run(["demo", "--chunks", "0"], capsys)
    assert "argument --chunks: must be at least 1, got 0" in err
