"""Quantized layers (``from_pretrained(weights=...)``, issue 49): the weight-only kernels
(int8, int4) compute the product of the weight the layer stands for, int8-dynamic the
product of each row quantized to int8 with it, whatever rows share the forward; the weight
is within half a quantization step of the float one, and an engine over a quantized model
gives ``model.generate``'s tokens on that same model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model.quantized import GROUPS, QuantizedLinear, check_weights, quantize
from kvboost_rag.core.store.fingerprint import model_fingerprint

KINDS = ["int8", "int4"]  # weight-only
ALL_KINDS = [*KINDS, "int8-dynamic"]


def layer(in_features: int = 256, out_features: int = 96, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_computes_the_dequantized_weights_product(
    kind: str, rows: int, bias: bool
) -> None:
    quantized = QuantizedLinear(layer(bias=bias), kind, rows=64)  # the kernel at every count
    x = torch.randn(2, rows, 256)
    expected = F.linear(x, quantized.dequantized(torch.float32), quantized.bias)
    torch.testing.assert_close(quantized(x), expected, atol=2e-5, rtol=1e-5)
    dense = QuantizedLinear(layer(bias=bias), kind, rows=0)  # the dense product at every count
    torch.testing.assert_close(dense(x), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_dynamic_multiplies_each_row_quantized_to_int8(dtype: torch.dtype, bias: bool) -> None:
    quantized = QuantizedLinear(layer(bias=bias).to(dtype), "int8-dynamic")
    x = torch.randn(2, 5, 256, dtype=dtype)
    x[0, 1, 7] = 40.0  # an outlier: its row's scale only
    rows = x.double().reshape(-1, 256)
    step = rows.abs().amax(1, keepdim=True) / 127
    q = torch.round(rows / step)
    expected = (q @ quantized.q.double().T) * quantized.scale.double() * step
    if bias:
        expected = expected + quantized.bias.double()
    got = quantized(x)
    assert got.dtype == dtype and got.shape == (2, 5, 96)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(
        got.double().reshape(-1, 96), expected, atol=tolerance, rtol=tolerance
    )
    # Integer sums and a scale per row: a row's output is the same alone or among others
    for i in range(5):
        assert torch.equal(quantized(x[:, i : i + 1]), got[:, i : i + 1])
    # and near the float product (8-bit inputs: about 1% of its size on random inputs)
    dense = F.linear(x.float(), quantized.dequantized(torch.float32), quantized.bias)
    assert float((got.float() - dense).norm() / dense.norm()) < 0.03


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_the_quantized_weight_is_within_half_a_step_of_the_float_one(kind: str) -> None:
    linear = layer(in_features=192)  # int4: groups of 64 (192 is no multiple of 128)
    quantized = QuantizedLinear(linear, kind)
    error = (quantized.dequantized(torch.float32) - linear.weight).abs()
    if kind != "int4":
        step = quantized.scale[:, None]
    else:
        assert quantized.group == 64
        step = quantized.scales_and_zeros[..., 0].T.repeat_interleave(64, dim=1)
    assert bool((error <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_activations_take_the_kernel_within_bf16_rounding(kind: str) -> None:
    quantized = QuantizedLinear(layer().to(torch.bfloat16), kind, rows=4)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    expected = F.linear(x.float(), quantized.dequantized(torch.float32), quantized.bias.float())
    torch.testing.assert_close(quantized(x).float(), expected, atol=0.05, rtol=0.02)


def test_layers_the_kernels_cannot_take_stay_float() -> None:
    assert not QuantizedLinear.supports(torch.nn.Linear(100, 96), "int4")  # 100: no group
    assert not QuantizedLinear.supports(torch.nn.Linear(128, 90), "int4")  # 90 outputs
    assert QuantizedLinear.supports(torch.nn.Linear(100, 90), "int8")
    assert not QuantizedLinear.supports(torch.nn.Linear(64, 64).half(), "int8")
    assert all(128 % g == 0 for g in GROUPS)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_an_engine_over_a_quantized_model_gives_generates_tokens(kind: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    model = make_model("llama")
    before = model_fingerprint(model, tokenizer)
    layers = quantize(model, kind)
    assert layers and all(type(m) is not torch.nn.Linear for m in model.model.modules())
    assert model_fingerprint(model, tokenizer) != before  # its KV is not the float model's
    prompt = "The quick brown fox jumps over the lazy dog while the cat watches. Who is lazy?"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    expected = out[0, ids.shape[1] :].tolist()
    for fidelity in ("exact", "balanced"):
        engine = KVBoost(model, tokenizer, KVBoostConfig(fidelity=fidelity))
        engine.warm(prompt[:40])  # a cached prefix, then the rest
        result = engine.generate(prompt, max_new_tokens=10, stop=[])
        assert result.reused_tokens == 40
        assert result.token_ids == expected, fidelity


def test_weights_is_checked_before_anything_loads() -> None:
    cpu = torch.device("cpu")
    assert check_weights(None, cpu) is None and check_weights("int4", cpu) == "int4"
    with pytest.raises(ValueError, match="runs on a CPU"):
        check_weights("int8", torch.device("meta"))
    with pytest.raises(
        ValueError,
        match=r"weights must be one of 'int8', 'int4', 'int8-dynamic', 'gguf', 'dense' or None",
    ):
        KVBoost.from_pretrained("no-such-model", weights="int5")
    with pytest.raises(ValueError, match="weights must be"):
        KVBoost.from_pretrained("no-such-model", weights=8)  # type: ignore[arg-type]


@pytest.mark.embedded
def test_the_adapters_load_quantized_weights() -> None:
    from kvboost_rag.integrations.langchain import ChatKVBoost
    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    chat = ChatKVBoost(model_id="smollm2-135m-instruct", weights="int4", max_tokens=2)
    assert type(chat.kv_engine.model.lm_head) is QuantizedLinear
    assert chat.kv_engine.model.lm_head.kind == "int4"
    llm = KVBoostLLM.from_model_id("smollm2-135m-instruct", weights="int8", max_tokens=2)
    assert llm.engine.model.lm_head.kind == "int8"
    with pytest.raises(ValueError, match="weights"):
        ChatKVBoost(model_id="smollm2-135m-instruct", weights="int3")


def test_int8_dynamic_kv_is_not_taken_for_int8s(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The same int8 weights computed with 8-bit inputs give other KV: the fingerprint the
    stores key passages by tells the two apart."""
    weight_only, dynamic = make_model("llama"), make_model("llama")
    quantize(weight_only, "int8")
    quantize(dynamic, "int8-dynamic")
    assert model_fingerprint(weight_only, tokenizer) != model_fingerprint(dynamic, tokenizer)
