"""The one-run study (benchmarks.suite) on a tiny random model (no timings asserted)."""

import json
from pathlib import Path

import pytest

from benchmarks.suite import run as suite
from benchmarks.suite.report import END, START, bench_markdown, update_readme
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.chart import draw
from kvboost_rag.bench.common.systems import machine

TINY_PLAN = suite.Plan(
    rag_queries=1,
    pool=14,
    popular_pool=8,
    popular_queries=2,
    chat_repeats=1,
    chat_new_tokens=2,
    cold_prompts=1,
)


@pytest.mark.slow
def test_bench_run_covers_every_workload_and_system(tiny_dir: Path, tmp_path: Path) -> None:
    base = KVBoost.from_pretrained(
        str(tiny_dir), dtype="float32", config=KVBoostConfig(fidelity="exact")
    )
    report = {
        "command": "kvboost-rag bench (test)",
        "model": "tiny",
        "machine": machine(base),
        "wall_s": 0.0,
    } | suite.run(base, TINY_PLAN, with_peer=True, seed=0)
    systems = ["full prefill", "exact prefix cache", "fast", "balanced"]
    for name in ("rag-1k", "rag-2k", "popular", "cold"):
        rows = report["workloads"][name]["systems"]
        assert list(rows)[:4] == systems
        assert all(r["median_ttft_ms"] > 0 for r in rows.values())
    assert report["workloads"]["rag-2k"]["median_prompt_tokens"] > 1500
    assert report["workloads"]["rag-1k"]["systems"]["fast"]["reuse_pct"] > 50  # pool warmed
    assert report["workloads"]["cold"]["systems"]["fast"]["reuse_pct"] < 50
    chat = report["workloads"]["chat"]["systems"]
    assert chat["exact prefix cache"]["identical_output_pct"] == 100  # fp32, exact reuse
    peers = [n for n in rows if n.startswith("kvboost")]
    assert peers or report["not_run"], "the peer either ran or says why not"
    markdown = bench_markdown(report, "bench.png")
    assert all(f"| {name} |" in markdown for name in systems + peers)
    assert draw(report, tmp_path / "docs" / "bench.png").stat().st_size > 0
    (tmp_path / "docs" / "bench.json").write_text(json.dumps(report))
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n{START}\nold numbers\n{END}\n## Next\n")
    update_readme(readme, tmp_path / "docs" / "bench.json")
    text = readme.read_text()
    assert "old numbers" not in text and text.endswith(f"{END}\n## Next\n")
    assert "![TTFT and task accuracy per system](docs/bench.png)" in text
    assert "| balanced |" in text and "kvboost-rag bench (test)" in text
