"""The lm_head on a oneDNN-packed weight (``core/model/packed.py``): the runner's logits are
the model's own on every architecture whose forward is decoder then head, a model that
changes its logits after the head keeps its forward, a head changed after packing is packed
again, and the config's switch is obeyed."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, make_model

from kvboost_rag import KVBoostConfig
from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.generation.slots import SlotCache
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.attention import install
from kvboost_rag.core.model.packed import MEASURED_ELEMENTS, PackedHead, supported

pytestmark = pytest.mark.skipif(
    not supported(make_model("llama")), reason="no oneDNN linear on this machine"
)


def runner_for(arch: str) -> Runner:
    model = make_model(arch)
    install(model)
    support = model_support(model)
    return Runner(model, support, SlotCache(len(support.layer_types)))


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def softcapped(model: torch.nn.Module) -> bool:
    return bool(getattr(model.config, "final_logit_softcapping", None))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_head_gives_the_models_logits_or_stays_off(arch: str) -> None:
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
    # A soft-capped model's forward does more than decoder then head: the check finds it.
    assert runner.head.usable(measured=False) is not softcapped(runner.model)
    torch.testing.assert_close(got[True], got[False], atol=2e-5, rtol=0)


def test_a_head_changed_after_packing_is_packed_again() -> None:
    runner = runner_for("llama")
    assert runner.head.usable(measured=False)
    prompt = tokens(3, 12)
    with torch.inference_mode():
        before = runner.run_rows([0], [prompt], [list(range(12))], packed=[True])
    with torch.no_grad():
        runner.model.lm_head.weight.mul_(2.0)  # in place: the version counter moves
    with torch.inference_mode():
        after = runner.run_rows([0], [prompt], [list(range(12))], packed=[True])
        want = runner.model(input_ids=torch.tensor([prompt])).logits[:, -1:]
    torch.testing.assert_close(after, want.float(), atol=2e-5, rtol=0)
    torch.testing.assert_close(after, 2 * before, atol=2e-5, rtol=0)


def test_packing_is_used_only_as_the_requests_engines_say() -> None:
    runner = runner_for("llama")
    assert runner.head.usable(measured=False)  # packs and checks (the check runs the head)
    calls: list[int] = []
    hook = runner.model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.inference_mode():
            runner.run_rows([0], [tokens(4, 10)], [list(range(10))], packed=[True])
            packed_calls = len(calls)  # the packed head is not the module's forward
            runner.run_rows([0], [[7]], [[10]], packed=[True, None, False])  # one says no
    finally:
        hook.remove()
    assert packed_calls == 0
    assert len(calls) == 1


def test_a_small_head_is_not_timed_and_keeps_its_forward() -> None:
    # Timing a head this small decides by noise; two engines on equal models would then
    # round their logits differently (CI saw a 1.2e-6 gap between a warmed engine and one
    # reading the same passages from disk).
    runner = runner_for("llama")
    assert runner.model.lm_head.weight.numel() < MEASURED_ELEMENTS
    assert runner.head.usable(measured=False) and not runner.head.usable()


def test_an_unsupported_model_is_never_packed() -> None:
    model = make_model("llama").to(torch.float16)
    assert not PackedHead(model).usable(measured=False)


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_packed_head_takes_a_bool_or_none(value: object) -> None:
    with pytest.raises(ValueError, match="packed_head must be True or False or None"):
        KVBoostConfig(packed_head=value)  # type: ignore[arg-type]
