"""Exact prefix reuse equals full prefill (tiny random fp32 Llama and Qwen2)."""

import pytest
import torch

from kvboost_rag import KVBoost
from kvboost_rag.core.reuse import policy

TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from afar. "


def full_prefill_logits(engine: KVBoost, prompt: str) -> torch.Tensor:
    ids = engine.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return engine.model(ids).logits[0, -1]


def full_prefill_greedy(engine: KVBoost, prompt: str, n: int) -> list[int]:
    ids = engine.tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = engine.model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize(
    "prefix_chars, reused",
    [(8, 8), (40, 40), (21, 21)],
    ids=["one-block", "many-blocks", "partial-last-block"],
)
def test_cached_prefix_matches_full_prefill(
    engine: KVBoost, prefix_chars: int, reused: int
) -> None:
    prefix, prompt = TEXT[:prefix_chars], TEXT[:prefix_chars] + "Who is lazy?"
    assert engine.warm(prefix).tokens == prefix_chars  # byte tokenizer: one token per char
    logits = engine.first_token_logits(prompt)
    torch.testing.assert_close(logits, full_prefill_logits(engine, prompt), atol=1e-5, rtol=0)
    result = engine.generate(prompt, max_new_tokens=12)
    assert result.reused_tokens == reused
    assert result.recomputed_tokens == len(prompt) - reused
    model_eos = engine.model.generation_config.eos_token_id
    expected = full_prefill_greedy(engine, prompt, 12)
    if model_eos in expected:
        expected = expected[: expected.index(model_eos) + 1]
    assert result.token_ids == expected


def test_partial_tail_reuses_only_the_common_tokens(engine: KVBoost) -> None:
    engine.warm(TEXT[:21])  # 2 full blocks of 8 + a 5-token tail
    prompt = TEXT[:18] + "XYZ what?"  # shares 2 of the tail's 5 tokens
    result = engine.generate(prompt, max_new_tokens=4)
    assert result.reused_tokens == 18
    torch.testing.assert_close(
        engine.first_token_logits(prompt), full_prefill_logits(engine, prompt), atol=1e-5, rtol=0
    )


def test_divergence_inside_a_full_block_reuses_up_to_it(engine: KVBoost) -> None:
    engine.warm(TEXT[:24])  # 3 full blocks of 8
    prompt = TEXT[:20] + "XYZ what?"  # leaves the stored stream 4 tokens into block 3
    assert engine.generate(prompt, max_new_tokens=2).reused_tokens == 20
    torch.testing.assert_close(
        engine.first_token_logits(prompt), full_prefill_logits(engine, prompt), atol=1e-5, rtol=0
    )


def test_short_cached_prefix_is_not_worth_a_masked_prefill(engine: KVBoost) -> None:
    engine.warm(TEXT[:8])
    prompt = TEXT[:8] + "x" * 60  # 8 cached of 68 (under 1/6): a plain prefill is cheaper
    result = engine.generate(prompt, max_new_tokens=2)
    assert result.reused_tokens == 0
    torch.testing.assert_close(
        engine.first_token_logits(prompt), full_prefill_logits(engine, prompt), atol=1e-5, rtol=0
    )


def test_a_wide_decoder_continues_a_short_cached_prefix(
    engine: KVBoost, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Qwen2.5-Coder-0.5B and 1.5B measured a cached prefix of any length cheaper per token
    # fed than a plain prefill (policy.WIDE_DECODER); this tiny model stands in for one.
    monkeypatch.setattr(policy, "WIDE_DECODER", engine.model.config.hidden_size)
    wide = KVBoost(engine.model, engine.tokenizer, engine.config)
    assert wide.warm(TEXT[:8]).tokens == 8
    prompt = TEXT[:8] + "x" * 60
    assert wide.generate(prompt, max_new_tokens=2).reused_tokens == 8
    torch.testing.assert_close(
        wide.first_token_logits(prompt), full_prefill_logits(engine, prompt), atol=1e-5, rtol=0
    )


def test_fully_cached_prompt_still_generates(engine: KVBoost) -> None:
    engine.warm(TEXT[:32])
    result = engine.generate(TEXT[:32], max_new_tokens=6)
    assert result.reused_tokens == 31  # the last token is fed to produce the first logits
    assert (
        result.token_ids[:6] == full_prefill_greedy(engine, TEXT[:32], 6)[: len(result.token_ids)]
    )


def test_answer_becomes_reusable_prefix(engine: KVBoost) -> None:
    messages = [{"role": "user", "content": TEXT}]
    first = engine.chat(messages, max_new_tokens=10)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And?"}]
    second = engine.chat(messages, max_new_tokens=10)
    history = engine.tokenizer.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True
    )
    history_tokens = len(engine.tokenizer(history, add_special_tokens=False)["input_ids"])
    assert second.reused_tokens >= history_tokens // 8 * 8
    logits = engine.first_token_logits(
        engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert logits.shape[-1] == engine.model.config.vocab_size


def test_eviction_keeps_results_exact(arch: str, tokenizer) -> None:
    from conftest import make_model

    from kvboost_rag import KVBoostConfig

    small = KVBoost(
        make_model(arch), tokenizer, KVBoostConfig(block_tokens=8, max_cache_bytes=20_000)
    )
    for i in range(4):
        small.warm(f"{i} {TEXT}")
    assert small.stats().cache.evictions > 0
    assert small.stats().cache.bytes <= 20_000
    prompt = f"3 {TEXT}?"
    torch.testing.assert_close(
        small.first_token_logits(prompt), full_prefill_logits(small, prompt), atol=1e-5, rtol=0
    )


def test_seeded_sampling_matches_full_prefill_sampling(engine: KVBoost) -> None:
    prompt = TEXT + "Next:"
    engine.warm(TEXT)
    result = engine.generate(
        prompt, max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=7
    )
    again = engine.generate(prompt, max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    ids = engine.tokenizer(prompt, return_tensors="pt")["input_ids"]
    torch.manual_seed(7)
    out = engine.model.generate(
        ids, max_new_tokens=8, do_sample=True, temperature=0.9, top_p=0.95, top_k=50
    )
    expected = out[0, ids.shape[1] :].tolist()
    assert result.reused_tokens > 0
    assert result.token_ids == again.token_ids == expected[: len(result.token_ids)]
