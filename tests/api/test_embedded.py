"""End to end on the embedded SmolLM2-135M-Instruct (fp32, so outputs must be identical)."""

from pathlib import Path

import pytest
import torch

from kvboost_rag import KVBoost
from kvboost_rag.core.model.loading import resolve_model_path

pytestmark = pytest.mark.embedded

QUESTIONS = [
    "Name three primary colors.",
    "Which of them is the color of the sky?",
    "Write one sentence about that color.",
]


def full_prefill_chat(engine: KVBoost, messages: list[dict], n: int) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = engine.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = engine.model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_multi_turn_chat_reuses_history_and_matches_full_prefill(embedded: KVBoost) -> None:
    embedded.clear_cache()
    messages: list[dict] = [{"role": "system", "content": "You are a concise assistant."}]
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        result = embedded.chat(messages, max_new_tokens=24)
        assert result.token_ids == full_prefill_chat(embedded, messages, 24)
        if turn > 0:
            assert result.kv_reuse_ratio > 0.5
        messages.append({"role": "assistant", "content": result.text})
    assert embedded.model.dtype == torch.float32


def test_embedded_alias_reloads_from_the_converted_checkpoint() -> None:
    checkpoint = Path(resolve_model_path("smollm2-135m-instruct"))
    assert (checkpoint / "model.safetensors.index.json").exists() or (
        checkpoint / "model.safetensors"  # a folder converted before conversion streamed
    ).exists()  # converted once, then reused
    engine = KVBoost.from_pretrained("smollm2-135m-instruct", dtype="bfloat16")
    assert engine.model.dtype == torch.bfloat16
    assert (
        "Paris"
        in engine.chat(
            [{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=16
        ).text
    )
