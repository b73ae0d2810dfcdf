"""The one-run benchmark and ``kvboost-rag warm`` on a tiny random model (no timings asserted)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.suite import run as suite
from benchmarks.suite.report import END, START, bench_markdown, update_readme
from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.chart import draw
from kvboost_rag.bench.common.systems import machine
from kvboost_rag.cli import main

TINY_PLAN = suite.Plan(
    rag_queries=1,
    pool=14,
    popular_pool=8,
    popular_queries=2,
    chat_repeats=1,
    chat_new_tokens=2,
    cold_prompts=1,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with room for ~2k-token prompts, saved like any local checkpoint."""
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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


def test_cli_warm_folder_then_again_from_disk(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Alpha. The first file talks about apples and pears.")
    (docs / "b.txt").write_text("Beta. The second file talks about boats and rivers.")
    (docs / "skip.md").write_text("Not a text file, so not warmed.")
    cache = tmp_path / "cache"
    args = ["warm", str(docs), "--cache-dir", str(cache), "--model", str(tiny_dir)]
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
