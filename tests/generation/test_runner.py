"""The executor's one forward primitive: tokens fed at their positions into KV rows give
what one plain prefill gives, however they are split into forwards, batched with other
rows, scattered or moved between rows."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, make_model

from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.generation.slots import SlotCache
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.attention import install

N = 70  # past the tiny models' 32-token sliding window


def runner_for(arch: str) -> tuple[Runner, torch.nn.Module]:
    model = make_model(arch)
    install(model)
    support = model_support(model)
    return Runner(model, support, SlotCache(len(support.layer_types))), model


def prompt(seed: int, n: int = N) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_equals_one_prefill(arch: str) -> None:
    runner, model = runner_for(arch)
    tokens, want = prompt(0), full(model, prompt(0))
    with torch.inference_mode():
        for start in range(0, N, 9):  # a cold prefill, then cached-prefix continuations
            chunk = list(range(start, min(start + 9, N)))
            got = runner.run_rows([0], [[tokens[p] for p in chunk]], [chunk], keep=len(chunk))
            torch.testing.assert_close(got[0], want[chunk[0] : chunk[-1] + 1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rows_fed_together_equal_rows_fed_alone(arch: str) -> None:
    runner, model = runner_for(arch)
    a, b = prompt(1), prompt(2, N - 23)
    with torch.inference_mode():
        runner.run_rows([0, 1], [a[:40], b[:11]], [list(range(40)), list(range(11))])
        rest = [list(range(40, N)), list(range(11, len(b)))]
        got = runner.run_rows([0, 1], [a[40:], b[11:]], rest, keep=1)
        step = runner.run_rows([0, 1], [[5], [6]], [[N], [len(b)]], keep=1)  # one decode step
    torch.testing.assert_close(got[0, -1], full(model, a)[-1], atol=2e-5, rtol=0)
    torch.testing.assert_close(got[1, -1], full(model, b)[-1], atol=2e-5, rtol=0)
    torch.testing.assert_close(step[0, -1], full(model, [*a, 5])[-1], atol=2e-5, rtol=0)
    torch.testing.assert_close(step[1, -1], full(model, [*b, 6])[-1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])
def test_scattered_positions_recompute_in_place(arch: str) -> None:
    """A repair pass: positions fed out of order of the row's contents, between KV that is
    already exact, give the same logits as one prefill (every position sees what it would)."""
    runner, model = runner_for(arch)
    tokens = prompt(3)
    scattered = sorted({3, 4, 17, 30, 31, 32, 50, N - 1})
    kept = [p for p in range(N) if p not in scattered]
    with torch.inference_mode():
        runner.run_rows([0], [tokens], [list(range(N))])  # exact KV everywhere
        for p in scattered:  # forget the scattered positions' KV
            runner.slots.zero(0, p, p + 1)
        got = runner.run_rows([0], [[tokens[p] for p in scattered]], [scattered], keep=1)
    assert kept  # the rest was reused as it was
    torch.testing.assert_close(got[0, -1], full(model, tokens)[-1], atol=2e-5, rtol=0)


def test_moved_and_swapped_rows_keep_their_kv() -> None:
    runner, model = runner_for("llama")
    a, b = prompt(4), prompt(5)
    with torch.inference_mode():
        runner.run_rows([0], [a], [list(range(N))])
        runner.run_rows([1], [b], [list(range(N))])
        runner.slots.swap_rows(0, 1)
        got_b = runner.run_rows([0], [[7]], [[N]])
        runner.slots.move_row(1, 0)
        got_a = runner.run_rows([0], [[7]], [[N]])
    torch.testing.assert_close(got_b[0, -1], full(model, [*b, 7])[-1], atol=2e-5, rtol=0)
    torch.testing.assert_close(got_a[0, -1], full(model, [*a, 7])[-1], atol=2e-5, rtol=0)
