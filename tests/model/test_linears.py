"""The decoder's linear layers taken another way in the engine's forwards
(``core/model/linears.py``: ``W @ x.T``, or a weight packed for oneDNN): the same product as
``F.linear``, only inside the engine's forwards and only for the counts measured faster,
every architecture's runner logits unchanged, the model untouched for its other callers,
a changed weight packed anew, sibling projections one packed product, and the measured
choice mapped to the counts between the measured ones."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import ARCHITECTURES, make_model

from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.generation.slots import SlotCache
from kvboost_rag.core.model import linears
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.attention import install

WAYS = [linears.TRANSPOSED, linears.PACKED]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 48), (1, 3, 48), (2, 4, 48)])
def test_the_transposed_product_is_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(shape, generator=gen), torch.randn(80, 48, generator=gen)
    b = torch.randn(80, generator=gen) if bias else None
    got = linears.transposed(x, weight, b)
    assert got.shape == (*shape[:-1], 80) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def taking(way: str) -> linears.Ways:
    """Ways that take ``way`` at every row count."""
    table = dict.fromkeys(linears.CANDIDATES, way)
    return linears.Ways(table, table)


@pytest.mark.parametrize("way", WAYS)
def test_only_the_decoders_plain_linears_change_and_only_once_adopted(
    way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model("llama")
    before = copy.deepcopy(model)
    layers = linears.install(model)
    assert layers and all(type(layer) is linears.EngineLinear for layer in layers)
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # the head is not touched
    calls: list[int] = []
    real = linears.F.linear
    monkeypatch.setattr(linears.F, "linear", lambda *a: calls.append(1) or real(*a))
    ids = torch.tensor([tokens(1, 3)])
    with torch.inference_mode():
        want = before(input_ids=ids).logits
        plain = model(input_ids=ids).logits
        assert len(calls) >= len(layers)  # before ``adopt`` every layer runs F.linear
        calls.clear()
        linears.adopt(model, taking(way))
        inside = model(input_ids=ids).logits
    assert len(calls) < len(layers)  # then the decoder's layers took ``way``
    assert torch.equal(plain, want)  # bit for bit
    torch.testing.assert_close(inside, want, atol=2e-5, rtol=0)


def test_an_installed_model_copies_and_saves_as_its_own() -> None:
    model = make_model("qwen2")
    linears.install(model)
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)  # the copy's layers hold their own weights
    ids = torch.tensor([tokens(2, 4)])
    for way in WAYS:
        linears.adopt(model, taking(way))
        linears.adopt(twin, taking(way))
        with torch.inference_mode():
            assert not torch.allclose(twin(input_ids=ids).logits, model(input_ids=ids).logits)
    buffer.seek(0)
    assert set(torch.load(buffer)) == set(model.state_dict())


def test_a_changed_weight_is_packed_anew() -> None:
    model = make_model("llama")
    layer = linears.install(model)[0]
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))

    def packed() -> torch.Tensor:
        with torch.inference_mode():
            return layer.product(x, linears.PACKED)

    first = packed()
    with torch.no_grad():
        torch.testing.assert_close(first, F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
        layer.weight.mul_(2.0)  # in place: the weight's version moves
    torch.testing.assert_close(packed(), 2 * first, atol=1e-5, rtol=1e-5)
    layer.weight = torch.nn.Parameter(torch.ones_like(layer.weight))  # a new tensor
    with torch.no_grad():
        torch.testing.assert_close(packed(), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sibling_projections_are_one_packed_product(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed, a layer's query/key/value and gate/up projections are one product on their
    stacked weights (Phi-3 stores them stacked already): 4 products a decoder layer instead
    of 7, and the model's logits."""
    model = make_model(arch)
    layers = linears.install(model)
    decoder_layers = model.config.num_hidden_layers
    groups = {id(layer.fused) for layer in layers if layer.fused}
    assert len(groups) == (0 if arch == "phi3" else 2 * decoder_layers)
    products: list[int] = []
    real = linears.packed_linear
    monkeypatch.setattr(linears, "packed_linear", lambda *a: products.append(1) or real(*a))
    ids = torch.tensor([tokens(3, 6)])
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        linears.adopt(model, taking(linears.PACKED))
        products.clear()  # packing the weights in ``adopt`` ran none
        got = model(input_ids=ids).logits
    assert len(products) == (len(layers) if arch == "phi3" else 4 * decoder_layers)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_every_way_is_timed_on_the_same_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed, a group's first member computes all its members' products: the layers timed
    hold whole groups, else the packed way is timed on more work than the others."""
    layers = linears.install(make_model("llama"))
    monkeypatch.setattr(linears, "STREAMED_BYTES", 1)  # streamed: the first layer's worth
    for timed in (linears._one_of_each_shape(layers), linears._streamed(layers)):
        assert timed
        groups = {id(layer.fused) for layer in timed if layer.fused}
        for layer in layers:
            if layer.fused is not None and id(layer.fused) in groups:
                assert layer in timed


def test_a_sibling_called_on_another_input_computes_its_own() -> None:
    """A member takes its group's product only for the input that product was for, and only
    once; otherwise (another input, a second call) it computes anew."""
    q, k, v = (linears.install(make_model("llama")) or [])[:3]
    assert q.fused is k.fused is v.fused is not None
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(2, q.in_features, generator=g) for _ in range(2))
    packed = linears.PACKED
    with torch.inference_mode():
        q.product(x, packed)
        for layer, given in ((k, y), (k, x), (k, x), (v, x), (v, y)):
            want = F.linear(given, layer.weight)
            torch.testing.assert_close(layer.product(given, packed), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_runner_logits_are_the_same_whichever_way_the_linears_take(arch: str) -> None:
    model = make_model(arch)
    install(model)
    support = model_support(model)
    runner = Runner(model, support, SlotCache(len(support.layer_types)))
    linears.install(model)
    a, b = tokens(1, 30), tokens(2, 21)
    got = {}
    with torch.inference_mode():
        runner.run_rows([0, 1], [a, b], [list(range(30)), list(range(21))])
        for way in [linears.PLAIN, *WAYS]:
            linears.adopt(model, taking(way))
            step = [[5, 9, 11], [6, 2, 4]]  # 6 rows fed, then 1 row of 4 tokens
            both = runner.run_rows([0, 1], step, [[30, 31, 32], [21, 22, 23]], keep=3)
            one = runner.run_rows([0], [[7, 8, 9, 10]], [[33, 34, 35, 36]], keep=4)
            got[way] = (both, one)
    for way in WAYS:
        for plain, other in zip(got[linears.PLAIN], got[way]):
            torch.testing.assert_close(other, plain, atol=2e-5, rtol=0)


def test_a_measured_count_also_takes_the_counts_below_it_down_to_the_last_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = make_model("llama")
    monkeypatch.setattr(linears, "MEASURED_BYTES", 0)
    ways = {4: linears.TRANSPOSED, 24: linears.PACKED, 1024: linears.PACKED}
    monkeypatch.setattr(
        linears,
        "_ranked",
        lambda layers, count, allowed: [
            ways[count] if ways.get(count) in allowed else "plain",
            *allowed,
        ],
    )
    measured = linears.measure(model).fastest
    assert measured == ways
    assert [linears.way_for(measured, n) for n in (1, 2, 3, 4, 5, 17, 24, 25, 300, 5000)] == [
        *["plain", "plain", "transposed", "transposed", "plain", "packed", "packed"],
        *["plain", "packed", "packed"],
    ]
    layers = linears.install(model)  # packed once: each layer, or its siblings together
    assert all((layer._packed is None) == (layer.fused is not None) for layer in layers)
    assert all(layer.fused._packed._entry for layer in layers if layer.fused)  # type: ignore[union-attr]
    monkeypatch.setattr(linears, "_same", lambda layer, way: way == linears.PLAIN)
    assert linears.measure(model) == linears.NONE  # products differ: every count runs F.linear


def test_a_small_decoder_is_not_measured_and_nothing_is_packed() -> None:
    model = make_model("llama")  # a few KB of linear weights
    assert linears.measure(model) == linears.NONE
    assert all(layer._packed is None for layer in linears.install(model))


def test_packing_is_a_candidate_only_up_to_its_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("llama")
    monkeypatch.setattr(linears, "MEASURED_BYTES", 0)
    offered: list[tuple[str, ...]] = []
    monkeypatch.setattr(
        linears, "_ranked", lambda layers, count, ways: offered.append(tuple(ways)) or ways[::-1]
    )
    assert set(linears.measure(model).fastest.values()) == {linears.PACKED}
    monkeypatch.setattr(linears, "PACKED_BYTES", 1)
    offered.clear()
    assert set(linears.measure(model).fastest.values()) == {linears.TRANSPOSED}
    assert all(linears.PACKED not in ways for ways in offered)


@pytest.mark.usefixtures("packed_up_to_8_rows")
def test_the_engines_runner_measures_its_counts_when_it_warms_up(tokenizer: Any) -> None:
    from kvboost_rag import KVBoost, KVBoostConfig

    model = make_model("llama")
    engine = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))
    assert engine._handle.executor.batch.runner.ways == linears.Ways(
        dict.fromkeys((1, 2, 4, 8), "packed"), {}
    )
    layers = linears.install(engine._handle.engine_model)
    assert layers and all(layer.table[1] == "packed" for layer in layers)
    assert not any(type(m) is linears.EngineLinear for m in model.modules())  # the user's


def test_a_users_torch_compile_traces_the_installed_layers_whole() -> None:
    model = make_model("llama")
    linears.install(model)
    mlp = model.get_decoder().layers[0].mlp
    compiled = torch.compile(mlp, backend="eager", fullgraph=True)  # a graph break raises
    x = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), mlp(x))


def _other_engines_done() -> None:
    """Wait for the work every live executor has queued (earlier tests' engines run their
    first-use forwards in the background)."""
    import gc

    from kvboost_rag.core.generation.executor import Executor

    for thing in gc.get_objects():
        if type(thing) is Executor:  # not isinstance: dead weak proxies raise
            thing.drain()


def test_a_model_packs_once_one_of_its_engines_allows_it(
    monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    """``packed_linears=False`` alone: no packed copy kept and none taken. Once another
    engine on the model allows packing, the model keeps the copies and every engine's
    forwards take them (one speed profile a model), with the same answers."""
    from kvboost_rag import KVBoost, KVBoostConfig

    _other_engines_done()  # their background work would run through the patched product
    monkeypatch.setattr(linears, "MEASURED_BYTES", 0)
    # packed is the fastest wherever it is offered, else F.linear
    monkeypatch.setattr(
        linears, "_ranked", lambda layers, count, ways: sorted(ways, key=lambda w: w != "packed")
    )
    taken: list[str] = []
    product = linears.EngineLinear.product
    monkeypatch.setattr(
        linears.EngineLinear,
        "product",
        lambda self, x, way: taken.append(way) or product(self, x, way),
    )
    model = make_model("llama")
    against = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact", packed_linears=False))
    layers = linears.install(against._handle.engine_model)

    def copies() -> list[bool]:
        groups = {id(layer.fused): layer.fused for layer in layers if layer.fused}.values()
        alone = [layer._packed is not None for layer in layers if layer.fused is None]
        return alone + [group._packed._entry is not None for group in groups]

    assert not any(copies())
    taken.clear()
    want = against.generate("one two three four five", max_new_tokens=6).token_ids
    assert linears.PACKED not in taken  # (F.linear, the fastest left, runs as nn.Linear)

    allowing = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))  # measured again
    assert all(copies())
    for engine in (allowing, against):
        taken.clear()
        assert engine.generate("one two three four five", max_new_tokens=6).token_ids == want
        assert linears.PACKED in taken


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_packed_linears_takes_a_bool(value: object) -> None:
    from kvboost_rag import KVBoostConfig

    with pytest.raises(ValueError, match="packed_linears must be True or False"):
        KVBoostConfig(packed_linears=value)  # type: ignore[arg-type]
