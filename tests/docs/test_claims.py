"""Numbers the README and the guides quote in prose, checked against the records they come
from (``docs/bench/*.json``) and the code's defaults; the tables are generated instead
(``scripts/docs_pages.py``, ``tests/docs/test_pages.py``). Issue 48: `balanced` was "the 30%
of its tokens the question attends to most" in three places while the code ran another
repair, and the guides quoted speed-ups of records since replaced."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from collections.abc import Callable
from typing import Any

import pytest
from code_blocks import ROOT


def _fidelity_tables() -> Any:
    path = ROOT / "scripts" / "fidelity_tables.py"
    spec = importlib.util.spec_from_file_location("fidelity_tables", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _fidelity_tables()


def level(model: str, name: str) -> dict[str, Any]:
    """The front record's totals for fidelity level ``name`` as the code runs it now, and
    the range of its per-workload TTFT speed-ups."""
    from benchmarks.front.options import OPTIONS

    report = tables._record(model)
    option = tables.measured_option(tables._measured(report, OPTIONS), name)
    cells = [c["systems"][option]["speedup"] for c in report["cells"].values()]
    return {**report["totals"][option], "low": min(cells), "high": max(cells)}


def bench(name: str) -> dict[str, Any]:
    return json.loads((ROOT / "docs" / "bench" / name).read_text())  # type: ignore[no-any-return]


def langchain_speedup(system: str) -> float:
    systems = bench("langchain-float32.json")["systems"]
    base = statistics.median(systems["HuggingFacePipeline (full prefill)"]["second_ttft"])
    return base / statistics.median(systems[f"ChatKVBoost {system}"]["second_ttft"])  # type: ignore[no-any-return]


def llamaindex_speedups() -> dict[str, float]:
    modes = bench("llamaindex.json")["modes"]
    return {mode: row["speedup_vs_huggingface_llm"] for mode, row in modes.items()}


def _balanced_15(m: re.Match[str]) -> None:
    b, low_high = level("1.5B", "balanced"), (level("1.5B", "balanced")["kept"])
    assert int(m["kept"]) == low_high[0] == low_high[1]  # "kept all N"
    assert m["x"] == f"{b['ttft_speedup']:.2f}"
    assert (m["low"], m["high"]) == (f"{b['low']:.1f}", f"{b['high']:.1f}")


def _balanced_05(m: re.Match[str]) -> None:
    b = level("0.5B", "balanced")
    assert [int(m["kept"]), int(m["of"])] == b["kept"]
    assert m["x"] == f"{b['ttft_speedup']:.1f}"
    assert (m["low"], m["high"]) == (f"{b['low']:.1f}", f"{b['high']:.1f}")


def _fast(m: re.Match[str]) -> None:
    big, small = level("1.5B", "fast"), level("0.5B", "fast")
    assert m["x15"] == f"{big['ttft_speedup']:.1f}" and m["x05"] == f"{small['ttft_speedup']:.1f}"
    assert [int(m["k15"]), int(m["of15"])] == big["kept"]
    assert [int(m["k05"]), int(m["of05"])] == small["kept"]
    assert (int(m["p15"]), int(m["p05"])) == (round(big["kept_pct"]), round(small["kept_pct"]))


def _readme(m: re.Match[str]) -> None:
    balanced, fast = level("1.5B", "balanced")["kept"], level("1.5B", "fast")["kept"]
    assert int(m["b"]) == balanced[0] == balanced[1] and int(m["f"]) == fast[0]


def _langchain(m: re.Match[str]) -> None:
    assert m["fast"] == f"{langchain_speedup('fast'):.2f}"
    assert m["balanced"] == f"{langchain_speedup('balanced'):.2f}"


def _llamaindex(m: re.Match[str]) -> None:
    speedups = llamaindex_speedups()
    one_call = [v for mode, v in speedups.items() if mode != "refine"]
    assert (m["low"], m["high"]) == (f"{min(one_call):.2f}", f"{max(one_call):.2f}")
    assert m["refine"] == f"{speedups['refine']:.2f}"


# (page, the claim as a pattern over its text with whitespace folded, its check)
CLAIMS: list[tuple[str, str, Callable[[re.Match[str]], None]]] = [
    (
        "README.md",
        r"\(`balanced` kept all (?P<b>\d+) of full prefill's right answers on this model, "
        r"`fast` (?P<f>\d+)\)",
        _readme,
    ),
    (
        "docs/guides/fidelity.md",
        r"on the 1\.5B it kept all (?P<kept>\d+) of full prefill's right answers at "
        r"(?P<x>[\d.]+)x shorter TTFT \(geometric mean over the six workloads, "
        r"(?P<low>[\d.]+)-(?P<high>[\d.]+)x each\)",
        _balanced_15,
    ),
    (
        "docs/guides/fidelity.md",
        r"on the 0\.5B (?P<kept>\d+) of (?P<of>\d+) at (?P<x>[\d.]+)x "
        r"\((?P<low>[\d.]+)-(?P<high>[\d.]+)x\)",
        _balanced_05,
    ),
    (
        "docs/guides/fidelity.md",
        r"(?P<x15>[\d.]+)x on the 1\.5B, .*? (?P<k15>\d+) of (?P<of15>\d+) overall "
        r"\((?P<p15>\d+)%\)\. On the 0\.5B (?P<k05>\d+) of (?P<of05>\d+) \((?P<p05>\d+)%\) at "
        r"(?P<x05>[\d.]+)x",
        _fast,
    ),
    (
        "docs/guides/langchain.md",
        r"`fast` answers the second question of a reordered pair (?P<fast>[\d.]+)x sooner "
        r"than the pipeline, reading every passage from cache; `balanced` (?P<balanced>[\d.]+)x",
        _langchain,
    ),
    (
        "docs/guides/llamaindex.md",
        r"`balanced` answers (?P<low>[\d.]+)-(?P<high>[\d.]+)x sooner than `HuggingFaceLLM` "
        r".*? and refine \(four calls; its first timed\) (?P<refine>[\d.]+)x",
        _llamaindex,
    ),
]


def folded(page: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / page).read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "page, claim, check", CLAIMS, ids=[f"{c[0]}:{i}" for i, c in enumerate(CLAIMS)]
)
def test_a_quoted_number_is_its_records(page: str, claim: str, check: Callable) -> None:
    found = list(re.finditer(claim, folded(page)))
    assert len(found) == 1, f"{page} no longer says (once): {claim}"
    check(found[0])


# What the docs said of repairs the code no longer runs (issue 48), each found on a page.
STALE = [
    "attends to most",
    "30% of its tokens",
    "30% of the passage tokens",
    "30% recompute",
    "90-106",
    "38-81",
    "balanced` now repairs by value deviation",
    "more repair / less repair",
    "balanced: deviation at 2",
]


@pytest.mark.parametrize("phrase", STALE)
def test_no_page_describes_a_repair_the_code_does_not_run(phrase: str) -> None:
    pages = [
        ROOT / "README.md",
        ROOT / "docs" / "index.md",
        *(ROOT / "docs" / "guides").glob("*.md"),
    ]
    said = [
        p.relative_to(ROOT).as_posix()
        for p in pages
        if phrase in re.sub(r"\s+", " ", p.read_text())
    ]
    assert not said, f"{said} say {phrase!r}"


def test_every_level_is_measured_as_the_code_runs_it() -> None:
    """A default changed without a new record fails here (and in docs_pages.py --check)."""
    from kvboost_rag.core.config import FIDELITY_LEVELS

    for model in tables.RECORDS:
        for name in FIDELITY_LEVELS:
            assert level(model, name)["kept"][1] > 0


def _backoff() -> tuple[str, str]:
    from kvboost_rag.core.store.backoff import Backoff

    return f"{Backoff().first:g}", f"{Backoff().longest:g}"


def _short_passage() -> tuple[str]:
    from conftest import RULE_SHORT_PASSAGE  # the engine's rule, read before tests patch it

    return (str(RULE_SHORT_PASSAGE),)


def _default(name: str, scale: float = 1) -> Callable[[], tuple[str]]:
    from kvboost_rag import KVBoostConfig

    return lambda: (f"{getattr(KVBoostConfig(), name) / scale:g}",)


def _serve_default(name: str, scale: float = 1) -> Callable[[], tuple[str]]:
    from kvboost_rag.serve.settings import ServeSettings

    return lambda: (f"{getattr(ServeSettings(), name) / scale:g}",)


def _schema_depth() -> tuple[str]:
    from kvboost_rag.core.tools.formats import MAX_SCHEMA_DEPTH

    return (str(MAX_SCHEMA_DEPTH),)


# (page, a default the page states, as a pattern whose groups are its numbers, the code's)
DEFAULTS: list[tuple[str, str, Callable[[], tuple[str, ...]]]] = [
    ("docs/guides/storage.md", r"back-off \(([\d.]+) s doubling to ([\d.]+) s\)", _backoff),
    ("docs/guides/troubleshooting.md", r"back-off \(([\d.]+) s doubling to ([\d.]+) s\)", _backoff),
    (
        "docs/guides/storage.md",
        r"`remote_timeout` \(([\d.]+) s\) in all",
        _default("remote_timeout"),
    ),
    ("docs/guides/storage.md", r"max_disk_bytes=(\d+) GiB\)", _default("max_disk_bytes", 1024**3)),
    ("README.md", r"short passages \(under (\d+) tokens on average\)", _short_passage),
    (
        "docs/guides/server.md",
        r"`--max-body-bytes` \(default (\d+) MiB\)",
        _serve_default("max_body_bytes", 2**20),
    ),
    (
        "docs/guides/server.md",
        r"`--max-queue` requests in flight \(default (\d+)\)",
        _serve_default("max_queue"),
    ),
    (
        "docs/guides/server.md",
        r"at most `--max-answers` answers \(default (\d+)\)",
        _serve_default("max_answers"),
    ),
    (
        "docs/guides/server.md",
        r"`--request-timeout` \(default (\d+) s\)",
        _serve_default("request_timeout_s"),
    ),
    (
        "docs/guides/server.md",
        r"finish first \(up to (\d+) s,",
        _serve_default("shutdown_timeout_s"),
    ),
    ("docs/guides/server.md", r"may nest up to (\d+) levels of JSON", _schema_depth),
    (
        "docs/guides/fidelity.md",
        r"short passages \(fewer than (\d+) tokens on average\)",
        _short_passage,
    ),
]


@pytest.mark.parametrize(
    "page, claim, value", DEFAULTS, ids=[f"{d[0]}:{i}" for i, d in enumerate(DEFAULTS)]
)
def test_a_stated_default_is_the_codes(page: str, claim: str, value: Callable) -> None:
    found = re.findall(claim, folded(page))
    assert found, f"{page} no longer says: {claim}"
    for numbers in found:
        said = (numbers,) if isinstance(numbers, str) else tuple(numbers)
        assert said == value(), f"{page} says {said}, the code {value()}"
