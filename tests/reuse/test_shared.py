"""The "shared" repair: sentences where passages share text, found from token ids alone."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokenizer

from kvboost_rag import KVBoost, KVBoostConfig, passage
from kvboost_rag.core.reuse.repair import RepairPlan, RepairSettings, choose_shared
from kvboost_rag.core.reuse.shared import SentenceEnds, sentences, shared_sentences

END = 0  # a token id standing for "." in the token-level cases below


def test_sentences_are_cut_after_each_end() -> None:
    tokens = [5, 6, END, 7, END, 8, 9]
    assert sentences(tokens, 0, 7, {END}) == [(0, 3), (3, 5), (5, 7)]
    assert sentences(tokens, 3, 6, {END}) == [(3, 5), (5, 6)]


def test_only_sentences_holding_a_run_another_passage_has_are_shared() -> None:
    a = [1, 2, 3, 4, 5, 90, END, 11, 12, END]  # "1 2 3 4 5" recurs in the next passage
    b = [20, 1, 2, 3, 4, 5, 91, END, 21, 22, 23, 24, END]
    c = [30, 31, 32, 33, END, 2, 3, 4, END]  # a 3-token overlap only: not shared
    tokens = a + b + c
    spans = [(0, 10), (10, 23), (23, 32)]
    assert shared_sentences(tokens, spans, {END}) == [(0, 7), (10, 18)]
    # a passage repeating its own text shares nothing
    assert shared_sentences([1, 2, 3, 4, 1, 2, 3, 4], [(0, 8)], {END}) == []


def _plan(tokens: list[int], spans: list[tuple[int, int]], repairable: list) -> RepairPlan:
    return RepairPlan(
        tokens, len(tokens), 0, repairable, [], passages=spans, sentence_ends=frozenset({END})
    )


def test_choose_shared_takes_shared_sentences_and_edges_of_repairable_passages() -> None:
    first = [1, 2, 3, 4, 5, END, 40, 41, 42, END]  # as encoded: never repaired
    second = [50, 51, 52, END, 1, 2, 3, 4, 6, END, 60, 61, END]
    tokens = first + second
    plan = _plan(tokens, [(0, 10), (10, 23)], [(10, 23)])
    chosen = choose_shared(plan, RepairSettings("shared", 2, 0.9, None), None)
    assert chosen == [10, 11, 14, 15, 16, 17, 18, 19]  # 2 edge tokens + the shared sentence


def test_choose_shared_recomputes_every_reused_token_past_its_budget() -> None:
    tokens = [1, 2, 3, 4, END] * 2
    plan = _plan(tokens, [(0, 5), (5, 10)], [(0, 5), (5, 10)])
    assert choose_shared(plan, RepairSettings("shared", 0, 0.5, None), None) == list(range(10))


def test_sentence_ends_read_the_tokens_text() -> None:
    tokenizer = make_tokenizer()
    ends = SentenceEnds(tokenizer)
    vocab = tokenizer.get_vocab()
    assert vocab["."] in ends and vocab["?"] in ends and vocab["\u010a"] in ends  # "\n"
    assert vocab["a"] not in ends and vocab[","] not in ends and "x" not in ends


LOOK_ALIKE = [
    "Note one. The access code for the red archive is 4512. Keep it.",
    "Note two. The access code for the blue archive is 7731. Keep it.",
    "Note three. The access code for the green archive is 1184. Keep it.",
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_repair_with_no_budget_is_a_full_prefill(arch: str, tokenizer) -> None:
    """Passages alike past the budget are all recomputed: the first token's logits are a
    full prefill's."""
    engine = KVBoost(
        make_model(arch),
        tokenizer,
        KVBoostConfig(block_tokens=8, repair="shared", recompute_ratio=0.05),
    )
    head = "Documents:\n"
    engine.warm_passages(LOOK_ALIKE, prefix=head)
    prompt = head + "".join(passage(d) + "\n" for d in LOOK_ALIKE[::-1]) + "Code for blue?"
    result = engine.generate(prompt, max_new_tokens=1)
    assert result.passages_hit + result.passages_unused == 3  # found, mostly recomputed
    tokens = engine.tokenize(prompt)
    with torch.no_grad():
        full = engine.model(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(engine.first_token_logits(prompt), full, atol=1e-4, rtol=0)


@pytest.mark.embedded
def test_on_a_real_tokenizer_the_look_alike_sentences_are_chosen() -> None:
    from transformers import AutoTokenizer

    from kvboost_rag.core.model.loading import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    docs = [LOOK_ALIKE[0], "Cats sleep a lot during the day, often in the sun.", LOOK_ALIKE[1]]
    tokens: list[int] = []
    spans = []
    for doc in docs:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        spans.append((len(tokens), len(tokens) + len(ids)))
        tokens += ids
    plan = RepairPlan(
        tokens, len(tokens), 0, spans[1:], [], passages=spans, sentence_ends=SentenceEnds(tok)
    )
    chosen = choose_shared(plan, RepairSettings("shared", 2, 0.9, None), None)
    text = tok.decode([tokens[p] for p in chosen])
    # the second look-alike's sentences (its code sentence, its "Keep it."), and the
    # first two tokens of each repairable passage; nothing else of the cat passage
    assert text == "Cats sleepNote two. The access code for the blue archive is 7731. Keep it."
