import pytest

from kvboost_rag.cli import main


@pytest.mark.embedded
def test_demo_prints_answers_with_timings(capsys: pytest.CaptureFixture[str]) -> None:
    main(["demo", "--turns", "2", "--questions", "2", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert out.count("TTFT") == 4 and "full prefill" in out and "warmed 24 passages" in out
    assert "passages hit 7" in out  # every RAG passage was warmed first


def test_unknown_subcommand_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve"])
    assert "invalid choice" in capsys.readouterr().err
