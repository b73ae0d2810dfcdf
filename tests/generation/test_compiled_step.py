"""The compiled one-request step (``KVBoostConfig.compiled_step``) changes how fast an
answer comes, never what it is: fp32 greedy answers are token for token the eager step's,
its KV lands in the engine's rows, and where it cannot run the engine says why and decodes
eagerly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import make_model
from test_batching import together

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.generation.runner import Runner

WORK = [
    (f"Report {i}: the {'north ' * (i % 3)}depot ships crates. Which depot?", 10 + 7 * i)
    for i in range(4)
]


def engines(model: Any, tokenizer: Any, drafts: int, choice: str) -> tuple[KVBoost, KVBoost]:
    """An eager engine and one asking for the compiled step, on the same model."""
    config = KVBoostConfig(block_tokens=8, draft_tokens=drafts)
    eager = KVBoost(model, tokenizer, config)
    compiled = KVBoost(model, tokenizer, KVBoostConfig(**{**vars(config), "compiled_step": choice}))
    return eager, compiled


def compiled_steps(engine: KVBoost) -> int:
    stats = engine.stats().batch
    assert stats is not None
    return stats.compiled_steps


def answers(engine: KVBoost) -> list[list[int]]:
    return [engine.generate(q, max_new_tokens=n).token_ids for q, n in WORK]


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_compiled_steps_give_the_eager_steps_answers(arch: str, tokenizer: Any) -> None:
    eager, compiled = engines(make_model(arch), tokenizer, 0, "on")
    stats = compiled.stats().batch
    assert stats is not None and stats.compiled_state == "on", stats
    assert stats.compiled_check_ms is not None and min(stats.compiled_check_ms) > 0
    assert stats.compiled_seconds > 0
    want = answers(eager)
    assert compiled_steps(eager) == 0  # an eager engine's requests never take it
    got = answers(compiled)
    assert got == want
    # every step after the first token, but where the row outgrew its buffers' columns
    steps = compiled_steps(compiled)
    assert 0.8 * sum(len(a) - 1 for a in want) <= steps <= sum(len(a) - 1 for a in want)
    assert answers(eager) == want and compiled_steps(compiled) == steps
    # rows decoding together take the eager batched step; a lone row the compiled one
    batched = together([lambda w=w: compiled.generate(w[0], max_new_tokens=w[1]) for w in WORK])
    assert [r.token_ids for r in batched] == want
    assert compiled.stats().batch.peak > 1  # type: ignore[union-attr]
    # the buffers grew more rows: the same compile still takes a lone row, no recompile
    before = compiled_steps(compiled)
    assert answers(compiled) == want
    assert compiled_steps(compiled) - before >= steps
    assert compiled.stats().batch.compiled_state == "on"  # type: ignore[union-attr]


def test_drafts_are_fed_while_they_pay_for_the_eager_verify(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone row that could take the compiled step feeds its draft only while the draft's
    tokens it adds pay for the eager forward that verifies it: at a measured speed-up of 1
    always, at 100 (a fed draft adding 99 tokens, past its 8) never. Answers are the same
    either way."""
    model = make_model("llama")
    eager, compiled = engines(model, tokenizer, 8, "on")
    want = answers(eager)
    step = compiled._handle.executor.batch.runner.compiled
    fed: list[int] = []
    run_rows = Runner.run_rows

    def recording(self: Runner, rows: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        fed.append(len(tokens[0]))
        return run_rows(self, rows, tokens, *args, **kwargs)

    monkeypatch.setattr(Runner, "run_rows", recording)
    for gain, feeds in ((1.0, True), (100.0, False)):
        assert step.ms is not None
        monkeypatch.setattr(step, "ms", (10.0, 10.0 * gain))
        compiled._handle.executor.batch.drafting.times = None  # measured again from ``ms``
        fed.clear()
        assert answers(compiled) == want
        assert (max(fed[1:]) > 1) is feeds  # after the prompt's forward
    assert answers(eager) == want


def test_sliding_window_models_decode_eagerly_and_say_why(tokenizer: Any) -> None:
    eager, compiled = engines(make_model("mistral"), tokenizer, 0, "on")
    stats = compiled.stats().batch
    assert stats is not None and "sliding-window" in stats.compiled_state
    assert stats.compiled_check_ms is None and stats.compiled_seconds == 0
    assert answers(compiled) == answers(eager)
    assert compiled_steps(compiled) == 0


NO_COMPILER = """
import json
from conftest import make_model, make_tokenizer
from test_compiled_step import answers, compiled_steps, engines
eager, compiled = engines(make_model("llama"), make_tokenizer(), 0, "on")
same = answers(compiled) == answers(eager)
state = compiled.stats().batch.compiled_state
print(json.dumps({"state": state, "same": same, "steps": compiled_steps(compiled)}))
"""


def test_without_a_compiler_the_engine_decodes_eagerly(tmp_path: Any) -> None:
    """No C++ compiler on the PATH (inductor emits C++): the engine says so and decodes
    eagerly. In a process of its own, with an empty inductor cache (a compile cached on
    disk needs no compiler)."""
    tests = Path(__file__).parent
    env = {**os.environ, "PATH": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent)])
    done = subprocess.run(
        [sys.executable, "-c", NO_COMPILER], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["state"].startswith("eager: compiling failed (InductorError: InvalidCxxCompiler")
    assert report["same"] and report["steps"] == 0


def test_measured_keeps_it_only_where_it_was_faster(tokenizer: Any) -> None:
    eager, compiled = engines(make_model("qwen2"), tokenizer, 0, "measured")
    stats = compiled.stats().batch
    assert stats is not None and stats.compiled_check_ms is not None
    fast, slow = stats.compiled_check_ms
    if stats.compiled_state == "on":
        assert fast < slow
    else:
        assert stats.compiled_state.startswith("eager: the compiled step was not faster")
        assert fast >= slow
    assert answers(compiled) == answers(eager)
    assert (compiled_steps(compiled) > 0) is (stats.compiled_state == "on")


@pytest.mark.parametrize("value", [True, "yes", None, 1])
def test_compiled_step_takes_off_measured_or_on(value: Any) -> None:
    with pytest.raises(ValueError, match="compiled_step must be one of"):
        KVBoostConfig(compiled_step=value)
