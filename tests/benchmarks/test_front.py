"""The fidelity-front benchmark's quick path on a tiny random model (no timings asserted)."""

import json
from pathlib import Path

import pytest

from benchmarks.front import run as front
from benchmarks.front.tasks import is_correct


@pytest.mark.slow
def test_quick_front_reports_every_option_in_every_cell(
    tiny_dir: Path,
    tmp_path: Path,
) -> None:
    front.main(["--quick", "--dtype", "float32", "--model", str(tiny_dir), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "front-float32.json").read_text())
    assert (tmp_path / "front-float32.png").stat().st_size > 0
    cells = report["cells"]
    assert len(cells) == len(front.QUICK.cells("front"))
    assert {c["warm"] for c in cells.values()} == {"all", "half", "foreign"}
    assert {c["layout"] for c in cells.values()} == set(front.tasks.LAYOUTS)
    for cell in cells.values():
        options = front.FOREIGN if cell["warm"] == "foreign" else front.OPTIONS
        assert list(cell["systems"]) == ["full prefill", *options]
        full = cell["systems"]["full prefill"]
        for s in cell["systems"].values():
            assert s["speedup"] > 0 and s["median_ttft_ms"] > 0
            assert s["accuracy_share_pct"] is None or s["accuracy_share_pct"] >= 0
            # kept: of full prefill's right answers; each answer is there, whole
            assert (
                s["kept"][1]
                == full["kept"][0]
                == round(full["accuracy_pct"] * cell["queries"] / 100)
            )
            assert 0 <= s["kept"][0] <= s["kept"][1] and len(s["answers"]) == cell["queries"]
            assert s["median_ttlt_ms"] >= s["median_ttft_ms"] and s["ttlt_speedup"] > 0
        for name in options:
            s = cell["systems"][name]
            assert s["mean_kl"] >= -1e-4 and 0 <= s["greedy16_match_pct"] <= 100
            assert 0 <= s["passages_missed"] <= cell["passages"]
            assert 0 <= s["passages_foreign"] <= cell["passages"]
    assert cells["essay 2k headers all"]["median_prompt_tokens"] > 1500
    assert cells["fact 1k format_passages all"]["systems"]["prompt+none"]["reuse_pct"] > 50
    assert set(report["bos_vs_prefix"]) == set(front.SYSTEM_SETS["prefix"])
    main = [c for c in cells.values() if c["warm"] != "foreign"]
    for name, total in report["totals"].items():  # every cell's kept answers, added up
        assert total["kept"] == [sum(c["systems"][name]["kept"][i] for c in main) for i in (0, 1)]
    assert report["wall_s"] > 0


@pytest.mark.parametrize(
    ("answer", "output", "correct"),
    [
        ("1234", "The code is 1234.", True),
        ("that seems", " That seems strictly better.", True),
        ("that seems", "that seemed", False),
        ("12", "1234", False),
    ],
)
def test_answers_match_whole_words_in_order(answer: str, output: str, correct: bool) -> None:
    assert is_correct(answer, output) is correct


def test_a_needle_prompt_holds_one_planted_fact_where_the_cycle_puts_it() -> None:
    texts = [f"Plain essay piece number {i}. It says nothing in particular." for i in range(8)]
    queries, pool, _ = front.tasks.batch("needle", texts, 4, 6, seed=3, retriever=None, cycle=True)
    for i, query in enumerate(queries):
        planted = [d for d in query.docs if "access code" in d]
        assert len(planted) == 1 and query.docs.index(planted[0]) == query.position == i % 4
        assert query.answer in planted[0] and set(query.docs) <= set(pool)


def test_a_completion_prompt_is_the_layout_without_a_template(tokenizer) -> None:
    query = front.tasks.Query(["First doc.", "Second doc."], "Which doc?", "")
    text = front.tasks.prompt(tokenizer, "needle", "numbered", query, form="completion")
    head = front.tasks.warm_prefix(tokenizer, "needle", "numbered", form="completion")
    assert isinstance(text, str) and "<|im_start|>" not in text and text.endswith("\nAnswer:")
    marker = head.index("\u27e6")  # the placeholder passage's marker
    assert text.startswith(head[:marker]) and text.index("First doc.") >= marker


def test_a_plain_cell_sends_the_same_text_without_markers(
    tiny_dir: Path,
    tmp_path: Path,
) -> None:
    """``--marks marked,plain``: each main cell twice, the second as a client that cannot
    send markers; warmed passages are found by content there too."""
    from kvboost_rag.core.prompt.chunker import CLOSE, OPEN

    args = ["--quick", "--dtype", "float32", "--model", str(tiny_dir), "--out", str(tmp_path)]
    front.main([*args, "--systems", "marks", "--tasks", "fact", "--marks", "marked,plain"])
    report = json.loads((tmp_path / "front-marks-float32.json").read_text())
    marked, plain = (
        report["cells"]["fact 1k format_passages all"],
        report["cells"]["fact 1k format_passages all plain"],
    )
    assert plain["median_prompt_tokens"] == marked["median_prompt_tokens"]  # the same prompts
    reused = [c["systems"]["prompt+shared r<=0.40"] for c in (marked, plain)]
    assert [r["passages_missed"] for r in reused] == [0, 0]
    assert reused[0]["reuse_pct"] == reused[1]["reuse_pct"] > 0  # placed alike, reused alike
    query = front.tasks.Query(["First doc."], "Which doc?", "")
    text = front.tasks.prompt(None, "needle", "numbered", query, form="completion")
    assert front.tasks.unmarked(text) == text.replace(OPEN, "").replace(CLOSE, "")
    assert OPEN not in str(
        front.tasks.unmarked(front.tasks.prompt(None, "fact", "numbered", query))
    )
