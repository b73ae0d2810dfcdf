import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_model, make_tokenizer

from kvboost_rag import KVBoost, KVBoostConfig, format_passages
from kvboost_rag.cli import main


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


def test_unknown_subcommand_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve"])
    assert "invalid choice" in capsys.readouterr().err


def test_demo_and_cli_do_not_import_the_benchmarks() -> None:
    # A fresh interpreter: this test process may already have loaded kvboost_rag.bench.
    check = (
        "import sys, kvboost_rag.cli, kvboost_rag.demo; "
        "bench = [m for m in sys.modules if m.startswith('kvboost_rag.bench')]; "
        "assert not bench, bench"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


NOTES = [f"Note {i}: item {i} costs {i * 3} dollars." for i in range(3)]


@pytest.fixture
def tiny_engines(monkeypatch: pytest.MonkeyPatch) -> list[KVBoost]:
    """``warm`` loads a tiny random model instead of the embedded one; the engines it built."""
    built: list[KVBoost] = []

    def tiny(model: str, dtype: object = None, config: object = None) -> KVBoost:
        built.append(KVBoost(make_model("llama"), make_tokenizer(), config))  # type: ignore[arg-type]
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


def test_warm_takes_one_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(
            ["warm", str(tmp_path), "--cache-dir", str(tmp_path), "--prefix", "a", "--system", "b"]
        )
    assert "not allowed with argument" in capsys.readouterr().err


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
    assert (result.passages_hit, result.passages_missed) == (3, 0)


def test_warm_needs_a_destination(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--cache-dir, --remote-url or both"):
        main(["warm", str(tmp_path)])


def test_warm_skips_empty_and_non_utf8_files_with_a_warning_naming_each(
    tmp_path: Path, tiny_engines: list[KVBoost], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    for i, note in enumerate(NOTES):
        (folder / f"{i}.txt").write_text(note + "\n")
    (folder / "empty.txt").write_text("  \n")
    (folder / "latin1.txt").write_bytes("Caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.warns(UserWarning) as caught:
        main(["warm", str(folder), "--cache-dir", str(tmp_path / "cache")])
    messages = sorted(str(w.message) for w in caught)
    assert any("empty.txt: it is empty" in m for m in messages)
    assert any("latin1.txt: it is not UTF-8 text (byte 3" in m for m in messages)
    out = capsys.readouterr().out
    assert "warmed 3 files into 3 passages" in out and "skipped 2 files" in out
    with pytest.raises(SystemExit, match="empty.txt: it is empty"):
        main(["warm", str(folder), "--cache-dir", str(tmp_path / "cache"), "--strict"])
