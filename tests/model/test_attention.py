"""The engine's attention (``kvboost_sdpa``): the split form of a cached prefix's
continuation equals transformers' masked SDPA, and every forward the engine does not pass a
``Forward`` is SDPA itself; the user's model keeps its own attention."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, SLIDING_WINDOW, make_model
from transformers import DynamicCache

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model.arch import SLIDING, model_support
from kvboost_rag.core.model.attention import KEYWORD, NAME, Forward, install


def windows(model: torch.nn.Module) -> tuple[int | None, ...]:
    support = model_support(model)
    return tuple(support.sliding_window if t == SLIDING else None for t in support.layer_types)


SDPA_ARCHITECTURES = [a for a in ARCHITECTURES if a != "gemma2"]  # gemma2: eager (softcap)


@pytest.mark.parametrize("arch", SDPA_ARCHITECTURES)
@pytest.mark.parametrize("cached", [1, 20, 2 * SLIDING_WINDOW])
def test_a_split_continuation_equals_a_full_prefill(arch: str, cached: int) -> None:
    split, reference = make_model(arch), make_model(arch)
    assert install(split) and split.config._attn_implementation == NAME
    ids = torch.randint(3, 90, (1, cached + 3 * SLIDING_WINDOW // 2))
    with torch.inference_mode():
        want = reference(input_ids=ids).logits[0]
        cache = DynamicCache()
        split(input_ids=ids[:, :cached], cache=cache)
        steer = {KEYWORD: Forward(cached, windows(split))}
        got = split(input_ids=ids[:, cached:], cache=cache, **steer).logits[0]
    torch.testing.assert_close(got, want[cached:], atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_the_users_model_is_left_as_it_was(arch: str, tokenizer) -> None:
    """The engine runs its own copy of the model's modules over the same weights: the
    user's model keeps its classes and attention, and its generate gives what it gave."""
    from kvboost_rag.core.generation.handle import ModelHandle
    from kvboost_rag.core.model.linears import EngineLinear

    model = make_model(arch)
    ids = torch.randint(3, 90, (1, 50))
    before = model.generate(ids, max_new_tokens=12, do_sample=False)
    classes = [type(m) for m in model.modules()]
    engine = KVBoost(model, tokenizer, KVBoostConfig())
    engine.generate("one two three", max_new_tokens=4)
    assert model.config._attn_implementation == "sdpa"
    assert [type(m) for m in model.modules()] == classes
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), before)
    view = ModelHandle.of(model).engine_model
    assert view is not model and view.config._attn_implementation == NAME
    assert any(type(m) is EngineLinear for m in view.modules())
    ours = dict(view.named_parameters())
    assert all(ours[name] is p for name, p in model.named_parameters())  # no weight copied


def test_eager_models_are_left_alone(tokenizer) -> None:
    assert not install(make_model("gemma2"))  # softcapped attention runs eagerly
    model = make_model("llama")
    model.set_attn_implementation("eager")
    assert not install(model) and model.config._attn_implementation == "eager"
    engine = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact", block_tokens=8))
    engine.warm("A long system prompt about depots and crates. " * 3)
    result = engine.generate("A long system prompt about depots and crates. " * 3 + "Q?")
    assert result.reused_tokens > 0 and model.config._attn_implementation == "eager"
    assert engine._handle.engine_model.config._attn_implementation == "eager"


# several queries without a mask are a causal continuation: ``split_attention``'s case
@pytest.mark.parametrize(
    ("mask_kind", "heads", "kv_heads", "rows", "queries"),
    [
        (mask, *shape)
        for shape in [(4, 4, 1, 1), (6, 2, 1, 1), (6, 2, 3, 1), (6, 2, 3, 3), (4, 1, 2, 4)]
        for mask in [None, "bool", "additive"]
        if mask is not None or shape[-1] == 1
    ],
)
def test_few_query_attention_equals_sdpa(
    mask_kind: str | None, heads: int, kv_heads: int, rows: int, queries: int
) -> None:
    """The engine's decoding steps (one query a row, or a few drafted ones under the step's
    mask) take ``few_query_attention``: what transformers' SDPA computes for the same
    queries, keys, values and mask (GQA heads included)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvboost_rag.core.model.attention import few_query_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(rows, heads, queries, 16, generator=generator)
    key, value = (torch.randn(rows, kv_heads, 37, 16, generator=generator) for _ in range(2))
    allowed = torch.rand(rows, 1, queries, 37, generator=generator) > 0.3
    allowed[..., -1] = True  # every row sees its own position
    mask = {
        None: None,
        "bool": allowed,
        "additive": torch.zeros(allowed.shape).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        ),
    }[mask_kind]
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got = few_query_attention(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.fixture
def few_query_calls(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """One entry per call of ``few_query_attention`` from here on."""
    from kvboost_rag.core.model import attention as attention_module

    calls: list[int] = []
    original = attention_module.few_query_attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_module, "few_query_attention", counting)
    return calls


def test_few_queries_outside_the_engine_are_sdpa_itself(few_query_calls) -> None:  # type: ignore[no-untyped-def]
    """Only the forwards the engine marks as its rows' take the few-query form."""
    calls = few_query_calls
    model = make_model("llama")
    assert install(model)
    ids = torch.randint(3, 90, (1, 10))
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=3, do_sample=False)
        assert not calls
        cache = DynamicCache()
        model(input_ids=ids, cache=cache)
        model(input_ids=ids[:, :1], cache=cache, **{KEYWORD: Forward()})  # not the rows'
        assert not calls
        model(input_ids=ids[:, 1:2], cache=cache, **{KEYWORD: Forward(rows=True)})
        assert not calls  # the rows', where the products were not measured faster
        model(input_ids=ids[:, 2:3], cache=cache, **{KEYWORD: Forward(rows=True, few=True)})
        assert calls


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize(("heads", "kv_heads", "rows"), [(6, 2, 1), (6, 2, 3), (4, 1, 2)])
def test_grouped_queries_under_a_mask_equal_sdpa_without_copying_keys(
    mask_kind: str, heads: int, kv_heads: int, rows: int, monkeypatch
) -> None:
    """Several queries under a mask in the engine's forwards (a batched step with drafts, a
    repair pass) take SDPA's grouped heads: transformers' output, without ``repeat_kv``."""
    from transformers.integrations import sdpa_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvboost_rag.core.model import attention as attention_module

    generator = torch.Generator().manual_seed(1)
    query = torch.randn(rows, heads, 5, 16, generator=generator)
    key, value = (torch.randn(rows, kv_heads, 41, 16, generator=generator) for _ in range(2))
    allowed = torch.rand(rows, 1, 5, 41, generator=generator) > 0.3
    allowed[..., 0] = True
    mask = allowed
    if mask_kind == "additive":
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    copies = []
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or a[0])
    steer = {KEYWORD: Forward(rows=True)}
    got, _ = attention_module.attention(module, query, key, value, mask, scaling=0.3, **steer)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not copies


def test_a_users_torch_compile_traces_the_engines_attention_whole() -> None:
    """Under a user's ``torch.compile`` the registered attention is transformers' SDPA,
    unbroken."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvboost_rag.core.model import attention as attention_module

    generator = torch.Generator().manual_seed(2)
    query = torch.randn(2, 6, 3, 16, generator=generator)
    key, value = (torch.randn(2, 2, 9, 16, generator=generator) for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups = 3  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_module.attention(module, q, k, v, None, scaling=0.25)[0]

    compiled = torch.compile(run, backend="eager", fullgraph=True)  # a graph break raises
    want, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.25)
    torch.testing.assert_close(compiled(query, key, value), want)


@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("few", [True, False])
def test_rows_take_the_form_measured_faster(queries: int, few: bool, few_query_calls) -> None:
    """``Forward.few`` (the verdict of ``attention_choice``): the engine's rows of a few
    queries take the products where it holds, SDPA's grouped heads where not; in float32
    and bf16 both give transformers' output."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvboost_rag.core.model import attention as attention_module

    calls = few_query_calls
    generator = torch.Generator().manual_seed(3)
    module = torch.nn.Module()
    module.num_key_value_groups = 3  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]
    steer = {KEYWORD: Forward(rows=True, few=few)}
    for dtype, tolerance in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        calls.clear()
        query = torch.randn(2, 6, queries, 16, generator=generator).to(dtype)
        key, value = (torch.randn(2, 2, 41, 16, generator=generator).to(dtype) for _ in range(2))
        mask = torch.rand(2, 1, queries, 41, generator=generator) > 0.3
        mask[..., 0] = True
        want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        got, _ = attention_module.attention(module, query, key, value, mask, scaling=0.3, **steer)
        assert bool(calls) is few, dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
