"""``kvboost-rag warm`` on a tiny random model saved like a checkpoint."""

from pathlib import Path

import pytest

from kvboost_rag.cli.main import main


def test_cli_warm_folder_then_again_from_disk(
    tiny_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Alpha. The first file talks about apples and pears.")
    (docs / "b.txt").write_text("Beta. The second file talks about boats and rivers.")
    (docs / "skip.md").write_text("Not a text file, so not warmed.")
    cache = tmp_path / "cache"
    args = ["warm", str(docs), "--cache-dir", str(cache), "--model", tiny_model_dir]
    main([*args, "--dtype", "float32"])
    first = capsys.readouterr().out
    assert "warmed 2 files into 2 passages" in first and "2 new, 0 already cached" in first
    assert any(cache.rglob("*.safetensors"))
    main([*args, "--dtype", "float32"])  # a new engine: everything is found on disk
    assert "0 new, 2 already cached" in capsys.readouterr().out


def test_cli_warm_without_matching_files_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["warm", str(tmp_path), "--cache-dir", str(tmp_path / "c")])
    assert exit.value.code == 2  # bad usage: a folder with nothing to warm
    assert "no files match '*.txt'" in capsys.readouterr().err
