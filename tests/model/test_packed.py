"""Linear layers on oneDNN-packed weights (``core/model/packed.py``): the same logits as
``F.linear``, only inside the engine's forwards, a weight changed after packing is packed
again, and the config's switch is obeyed."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import ARCHITECTURES, make_model
from torch.overrides import TorchFunctionMode

from kvboost_rag import KVBoostConfig
from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.generation.slots import SlotCache
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.attention import install
from kvboost_rag.core.model.packed import PackedWeights, supported

pytestmark = pytest.mark.skipif(
    not supported(make_model("llama")), reason="no oneDNN linear on this machine"
)


class CountLinear(TorchFunctionMode):
    """Counts the ``F.linear`` calls that reach torch's own implementation."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += func is F.linear
        return func(*args, **(kwargs or {}))


def runner_for(arch: str) -> Runner:
    model = make_model(arch)
    install(model)
    support = model_support(model)
    return Runner(model, support, SlotCache(len(support.layer_types)))


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_steps_give_the_logits_of_plain_ones(arch: str) -> None:
    runner = runner_for(arch)
    a, b = tokens(1, 40), tokens(2, 29)
    with torch.inference_mode():
        runner.run_rows([0, 1], [a, b], [list(range(40)), list(range(29))], packed=[False])
        got = {}
        for packed in (False, True):
            step = [[5, 9, 11], [6, 2, 4]]
            got[packed] = runner.run_rows(
                [0, 1], step, [[40, 41, 42], [29, 30, 31]], keep=3, packed=[packed, packed]
            )
    assert runner.packed.usable(measured=False)
    torch.testing.assert_close(got[True], got[False], atol=2e-5, rtol=0)


def test_packing_takes_the_linear_calls_only_when_asked() -> None:
    runner = runner_for("llama")
    assert runner.packed.usable(measured=False)  # packs (and checks) before counting
    counter = CountLinear()
    with torch.inference_mode(), counter:
        runner.run_rows([0], [tokens(3, 40)], [list(range(40))], packed=[True])
        packed_calls = counter.calls
        runner.run_rows([0], [[7, 8]], [[40, 41]], packed=[False])
        plain_calls = counter.calls - packed_calls
        runner.run_rows([0], [[9]], [[42]], packed=[True])  # one token: never packed
        one_token_calls = counter.calls - packed_calls - plain_calls
    linears = sum(type(m) is torch.nn.Linear for m in runner.model.modules())
    # Packed, the 40-row layers reach F.linear (past MAX_ROWS); the 1-row lm_head does not.
    assert packed_calls == linears - 1
    assert plain_calls == one_token_calls == linears


def test_a_weight_changed_after_packing_is_packed_again() -> None:
    model = make_model("llama")
    weights = PackedWeights(model)
    assert weights.usable(measured=False)
    x = torch.randn(4, model.config.hidden_size)
    linear = model.lm_head
    with torch.inference_mode():
        with weights.active():
            before = linear(x)
    with torch.no_grad():
        linear.weight.mul_(2.0)  # an in-place update: the version counter moves
    with torch.inference_mode():
        with weights.active():
            after = linear(x)
        want = F.linear(x, linear.weight)
    torch.testing.assert_close(after, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(after, 2 * before, atol=1e-5, rtol=0)


def test_another_thread_calling_the_model_meanwhile_is_not_packed() -> None:
    model = make_model("llama")
    weights = PackedWeights(model)
    assert weights.usable(measured=False)
    counts: list[int] = []

    def user_call() -> None:
        counter = CountLinear()
        with torch.inference_mode(), counter:
            model(input_ids=torch.tensor([[5, 6]]))
        counts.append(counter.calls)

    with torch.inference_mode(), weights.active():
        thread = threading.Thread(target=user_call)
        thread.start()
        thread.join()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert counts == [linears]


def test_an_unsupported_model_is_never_packed() -> None:
    model = make_model("llama").to(torch.float16)
    weights = PackedWeights(model)
    assert not weights.usable(measured=False)


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_packed_weights_takes_a_bool_or_none(value: object) -> None:
    with pytest.raises(ValueError, match="packed_weights must be True, False or None"):
        KVBoostConfig(packed_weights=value)  # type: ignore[arg-type]
