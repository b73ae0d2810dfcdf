"""Every python block in the README runs as written (on the embedded model)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.embedded
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index: int, request, monkeypatch) -> None:
    if "REDIS_URL" in BLOCKS[index]:  # the shared-tier recipe: a private redis-server
        monkeypatch.setenv("REDIS_URL", request.getfixturevalue("redis_server").url)
    if "REDIS_CLUSTER_URL" in BLOCKS[index]:  # the cluster recipe: a private 3-master cluster
        monkeypatch.setenv("REDIS_CLUSTER_URL", request.getfixturevalue("redis_cluster").url)
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})


def test_readme_has_python_blocks() -> None:
    assert BLOCKS


def test_ci_runs_the_readme_test_command() -> None:
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README.read_text()


def test_readme_langchain_table_equals_its_json() -> None:
    import json

    from kvboost_rag.bench.rag.langchain_rag import table

    saved = README.parent / "docs" / "bench" / "langchain-bfloat16.json"
    assert table(json.loads(saved.read_text())) in README.read_text()


def test_readme_llamaindex_table_equals_its_json() -> None:
    import json

    from kvboost_rag.bench.rag.llamaindex_rag import table

    saved = README.parent / "docs" / "bench" / "llamaindex.json"
    assert table(json.loads(saved.read_text())) in README.read_text()


def test_readme_load_table_equals_its_json() -> None:
    import json

    from kvboost_rag.bench.load.report import table

    saved = README.parent / "docs" / "bench" / "load-float32.json"
    assert table(json.loads(saved.read_text())) in README.read_text()


def test_readme_bench_section_equals_bench_json(tmp_path: Path) -> None:
    from kvboost_rag.bench.suite.report import update_readme

    copy = tmp_path / "README.md"
    copy.write_text(README.read_text())
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    saved = README.parent / "docs" / "bench" / "bench.json"
    (tmp_path / "docs" / "bench" / "bench.json").write_text(saved.read_text())
    update_readme(copy, tmp_path / "docs" / "bench" / "bench.json")
    assert copy.read_text() == README.read_text()


@pytest.mark.parametrize("name", ["front-bfloat16", "front-probe-bfloat16"])
def test_readme_fidelity_tables_equal_their_json(name: str) -> None:
    import json

    from kvboost_rag.bench.front.report import markdown

    saved = README.parent / "docs" / "bench" / f"{name}.json"
    cells = ["fact 1k format_passages all", "essay 1k format_passages all"]
    assert markdown(json.loads(saved.read_text()), cells) in README.read_text()


def test_readme_agent_tables_equal_their_json() -> None:
    import json

    from kvboost_rag.bench.agent.run import table

    saved = json.loads((README.parent / "docs" / "bench" / "agent.json").read_text())
    text = table(saved)
    for name in saved["frameworks"]:
        start = text.index("| step", text.index(f"## {name}"))
        rows = text[start : text.index('{"steps"', start)].strip()
        assert rows in README.read_text(), name
