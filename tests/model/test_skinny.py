"""Linear layers over a few rows taken as ``W @ x.T`` (``core/model/skinny.py``): the same
product as ``F.linear``, only inside the engine's forwards and only for the counts allowed,
every architecture's runner logits unchanged, the model untouched for its other callers,
and the measured choice mapped to the counts between the measured ones."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from conftest import ARCHITECTURES, make_model

from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.generation.slots import SlotCache
from kvboost_rag.core.model import skinny
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.attention import install

ALL = frozenset(range(2, skinny.CANDIDATES[-1] + 1))


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 48), (1, 3, 48), (2, 4, 48)])
def test_the_transposed_product_is_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(shape, generator=gen), torch.randn(80, 48, generator=gen)
    b = torch.randn(80, generator=gen) if bias else None
    got = skinny.transposed(x, weight, b)
    assert got.shape == (*shape[:-1], 80) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_only_the_decoders_plain_linears_change_and_only_inside_rows(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = make_model("llama")
    before = copy.deepcopy(model)
    layers = skinny.install(model)
    assert layers and all(type(layer) is skinny.SkinnyLinear for layer in layers)
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # the head is not touched
    calls: list[int] = []
    real = skinny.transposed
    monkeypatch.setattr(
        skinny, "transposed", lambda x, w, b: calls.append(x.shape[-2]) or real(x, w, b)
    )
    ids = torch.tensor([tokens(1, 3)])
    with torch.inference_mode():
        want = before(input_ids=ids).logits
        plain = model(input_ids=ids).logits
        assert not calls  # outside ``rows`` every layer runs nn.Linear.forward
        with skinny.rows(frozenset({2})):
            model(input_ids=ids)  # 3 rows: not allowed
        assert not calls
        with skinny.rows(frozenset({3})):
            inside = model(input_ids=ids).logits
    assert len(calls) == len(layers) and set(calls) == {3}
    assert torch.equal(plain, want)  # bit for bit, for every other caller of the model
    torch.testing.assert_close(inside, want, atol=2e-5, rtol=0)


def test_an_installed_model_copies_and_saves_as_its_own() -> None:
    model = make_model("qwen2")
    skinny.install(model)
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)  # the copy's layers hold their own weights
    ids = torch.tensor([tokens(2, 4)])
    with torch.inference_mode(), skinny.rows(ALL):
        assert not torch.allclose(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    buffer.seek(0)
    assert set(torch.load(buffer)) == set(model.state_dict())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_runner_logits_are_the_same_with_every_count_transposed(arch: str) -> None:
    model = make_model(arch)
    install(model)
    support = model_support(model)
    runner = Runner(model, support, SlotCache(len(support.layer_types)))
    skinny.install(model)
    a, b = tokens(1, 30), tokens(2, 21)
    got = {}
    with torch.inference_mode():
        runner.run_rows([0, 1], [a, b], [list(range(30)), list(range(21))])
        for allowed in (frozenset(), ALL):
            runner.skinny = allowed
            step = [[5, 9, 11], [6, 2, 4]]  # 6 rows fed, then 1 row of 4 tokens
            both = runner.run_rows([0, 1], step, [[30, 31, 32], [21, 22, 23]], keep=3)
            one = runner.run_rows([0], [[7, 8, 9, 10]], [[33, 34, 35, 36]], keep=4)
            got[bool(allowed)] = (both, one)
    for plain, transposed in zip(got[False], got[True]):
        torch.testing.assert_close(transposed, plain, atol=2e-5, rtol=0)


def test_a_measured_count_also_takes_the_counts_below_it_down_to_the_last_measured(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    model = make_model("llama")
    monkeypatch.setattr(skinny, "_faster", lambda layers, count: count in (4, 24))
    assert skinny.measure(model) == frozenset({3, 4, *range(17, 25)})
    monkeypatch.setattr(skinny, "_same", lambda layer: False)  # products differ: none
    assert skinny.measure(model) == frozenset()


def test_the_engines_runner_measures_its_counts_when_it_warms_up(
    monkeypatch,
    tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    from kvboost_rag import KVBoost, KVBoostConfig

    monkeypatch.setattr(skinny, "_faster", lambda layers, count: count <= 8)
    model = make_model("llama")
    engine = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))
    assert engine._handle.executor.batch.runner.skinny == frozenset(range(2, 9))
    assert all(type(layer) is skinny.SkinnyLinear for layer in skinny.install(model))


def test_a_users_torch_compile_traces_the_installed_layers_whole() -> None:
    model = make_model("llama")
    skinny.install(model)
    mlp = model.get_decoder().layers[0].mlp
    compiled = torch.compile(mlp, backend="eager", fullgraph=True)  # a graph break raises
    x = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), mlp(x))
