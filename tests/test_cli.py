import subprocess
import sys

import pytest

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
