"""Every supported architecture, on tiny random fp32 models: exact reuse == generate, full
recompute == full prefill, re-rotated keys == a fresh encode (kvboost_rag.core.model.arch)."""

from dataclasses import replace

import pytest
import torch
from conftest import ARCHITECTURES, SLIDING_WINDOW, make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model.arch import inspect_model, model_support, rotation_errors
from kvboost_rag.core.model.kv import new_kv_of_layer, to_cache
from kvboost_rag.core.model.rope import Rotary, rerotate, rotations
from kvboost_rag.core.prompt.chunker import passage

SYSTEM = "You are a careful assistant. Answer briefly and cite the passage you used. "
DOCS = [
    "Paris is the capital of France and sits on the Seine.",
    "The Nile flows north through Egypt into the Mediterranean.",
    "Mount Fuji is the highest mountain in Japan.",
]
QUESTION = "Question: which river flows north? Answer:"


@pytest.fixture(params=ARCHITECTURES)
def model_arch(request: pytest.FixtureRequest) -> str:
    return request.param


def greedy(model, tokens: list[int], n: int) -> list[int]:
    ids = torch.tensor([tokens])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, ids.shape[1] :].tolist()


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def test_exact_path_after_warm_matches_generate(model_arch: str, tokenizer) -> None:
    model = make_model(model_arch)
    engine = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact", block_tokens=8))
    engine.warm(SYSTEM)
    prompt = SYSTEM + QUESTION
    tokens = engine.tokenize(prompt)
    assert len(tokens) > 3 * SLIDING_WINDOW  # the cached prefix alone is past the window
    torch.testing.assert_close(
        engine.first_token_logits(prompt), full_logits(model, tokens), atol=1e-5, rtol=0
    )
    result = engine.generate(prompt, max_new_tokens=12)
    assert result.reused_tokens == len(engine.tokenize(SYSTEM))
    assert result.token_ids == greedy(model, tokens, 12)[: len(result.token_ids)]
    again = engine.generate(prompt, max_new_tokens=12)  # now served from the stored prompt
    assert again.reused_tokens == len(tokens) - 1 and again.token_ids == result.token_ids


@pytest.mark.parametrize("strategy", ["deviation", "query"])
def test_full_recompute_equals_full_prefill(model_arch: str, tokenizer, strategy: str) -> None:
    model = make_model(model_arch)
    config = KVBoostConfig(
        fidelity="balanced", repair=strategy, recompute_ratio=1.0, block_tokens=8
    )
    engine = KVBoost(model, tokenizer, config)
    engine.warm_passages(DOCS)
    prompt = "Context:\n" + passage(DOCS[2]) + "\n" + passage(DOCS[0]) + "\n" + QUESTION
    tokens = engine.tokenize(prompt)
    torch.testing.assert_close(
        engine.first_token_logits(prompt), full_logits(model, tokens), atol=1e-4, rtol=0
    )
    result = engine.generate(prompt, max_new_tokens=10)
    # every position recomputed: the stored passages were found, not used
    assert (result.passages_hit, result.passages_unused, result.passages_missed) == (0, 2, 0)
    assert result.token_ids == greedy(model, tokens, 10)[: len(result.token_ids)]


def encode_keys(model, tokens: list[int], start: int) -> list[tuple]:
    """Each layer's (keys, values) of ``tokens`` encoded at positions ``start``, ...."""
    cache = to_cache([], model.config)
    positions = torch.arange(start, start + len(tokens))[None]
    with torch.no_grad():
        model(torch.tensor([tokens]), position_ids=positions, cache=cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_a_layers_new_kv_is_the_full_forwards_and_later_layers_do_not_run(
    model_arch: str, tokenizer
) -> None:
    """What the deviation repair compares the cached KV with: layer 1's keys and values of
    the new tokens, taken where that layer writes them, equal a whole forward's."""
    model = make_model(model_arch)
    tokens = [tokenizer.bos_token_id, *tokenizer(DOCS[1], add_special_tokens=False)["input_ids"]]
    split = 7
    whole = encode_keys(model, tokens, 0)
    cache = to_cache([(k[:, :, :split], v[:, :, :split]) for k, v in whole], model.config)
    ran: list[int] = []
    blocks = model_support(model).layers
    hooks = [
        b.register_forward_pre_hook(lambda *_, i=i: ran.append(i)) for i, b in enumerate(blocks)
    ]
    try:
        with torch.no_grad(), new_kv_of_layer(cache, 1) as caught:
            model(torch.tensor([tokens[split:]]), cache=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert ran == [0, 1] and len(caught) == 1
    keys, values = caught[0]
    torch.testing.assert_close(keys, whole[1][0][:, :, split:], atol=2e-5, rtol=0)
    torch.testing.assert_close(values, whole[1][1][:, :, split:], atol=2e-5, rtol=0)
    assert cache.layers[1].keys.shape[-2] == split  # layer 1 took no new tokens
    assert "update" not in vars(cache)  # the cache's own method again


def test_rerotated_keys_equal_a_fresh_encode(model_arch: str, tokenizer) -> None:
    model = make_model(model_arch)
    support = KVBoost(model, tokenizer).support
    tokens = [tokenizer.bos_token_id, *tokenizer(DOCS[1], add_special_tokens=False)["input_ids"]]
    assert len(tokens) > SLIDING_WINDOW
    delta = 45
    stored, fresh = encode_keys(model, tokens, 0), encode_keys(model, tokens, delta)
    rots = rotations(delta, support.rotaries, stored[0][0])
    for (keys, values), (fresh_keys, fresh_values), rot in zip(stored, fresh, rots, strict=True):
        torch.testing.assert_close(rerotate(keys, rot), fresh_keys, atol=2e-5, rtol=0)
        torch.testing.assert_close(values, fresh_values, atol=2e-5, rtol=0)


def test_gemma3_rotates_local_and_global_layers_with_their_own_base() -> None:
    model = make_model("gemma3")
    support = model_support(model)
    assert support.passage_reuse and support.sliding_window == SLIDING_WINDOW
    kinds = [r.layer_type for r in support.rotaries if r is not None]
    assert kinds == ["sliding_attention", "full_attention", "sliding_attention"]
    (local, _), (glob, _) = rotations(45, support.rotaries[:2], torch.zeros(1, 1, 1, 16))
    assert (local - glob).abs().max() > 0.1  # different bases, different rotations
    # One rotation for every layer (what a single rotary_emb gave) fails the start probe.
    one = Rotary(support.rotaries[1].module, "full_attention")
    errors = rotation_errors(model, replace(support, rotaries=(one,) * 3))
    assert errors[0] > 0.3 and errors[2] > 0.3 and errors[1] < 1e-4
    assert max(rotation_errors(model, support)) < 1e-4


def test_mixed_layer_types_get_one_mask_per_type() -> None:
    def build(window: int | None) -> torch.Tensor:
        return torch.tensor(window or 0)

    assert model_support(make_model("gemma2")).attention_masks(build) == {
        "full_attention": 0,
        "sliding_attention": SLIDING_WINDOW,
    }
    assert model_support(make_model("mistral")).attention_masks(build) == SLIDING_WINDOW
    assert model_support(make_model("qwen3")).attention_masks(build) == 0


def test_structure_is_read_once_per_model(tokenizer) -> None:
    model = make_model("phi3")
    engine = KVBoost(model, tokenizer)
    first, view = engine.support, engine._handle.engine_model
    assert KVBoost(model, tokenizer).support is first is model_support(view)
    assert len(first.layers) == len(first.attention) == 3
    assert first.attention[0] is view.model.layers[0].self_attn  # the engine's own modules
    assert model_support(model).attention[0] is model.model.layers[0].self_attn
    fresh = inspect_model(model)  # a fresh inspection decides the same
    assert (fresh.passage_reuse, fresh.reason) == (first.passage_reuse, first.reason)


def test_sliding_layers_keep_every_position_in_engine_caches() -> None:
    model = make_model("gemma3")
    kv = [(torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)) for _ in range(3)]
    cache = to_cache(kv, model.config)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [50, 50, 50]
    assert torch.equal(cache.layers[0].keys, kv[0][0]) and cache.get_seq_length() == 50


def test_length_dependent_rope_falls_back_to_exact_reuse(tokenizer) -> None:
    from conftest import _tiny_kwargs
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0}
    config = LlamaConfig(**_tiny_kwargs(len(tokenizer)), rope_parameters=rope)
    model = LlamaForCausalLM(config).eval()
    with pytest.warns(UserWarning, match="depends on the prompt's length"):
        engine = KVBoost(model, tokenizer, KVBoostConfig(fidelity="balanced"))
    assert not engine.support.passage_reuse
    result = engine.generate(QUESTION, passages=DOCS, max_new_tokens=2)
    assert result.passages_hit == result.passages_missed == 0
    with pytest.warns(UserWarning, match=r"nothing warmed: passage reuse is off \(.*length"):
        warmed = engine.warm_passages(DOCS)
    assert (warmed.documents, warmed.units, warmed.new, warmed.bytes) == (len(DOCS), 0, 0, 0)
