"""Prompt-lookup speculation changes how fast an answer comes, never what it is: greedy
output is token for token plain decoding's, sampled output keeps its distribution, and
grammars, stop strings and cancellation hold mid-draft."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from typing import Any

import pytest
import torch
from conftest import ARCHITECTURES, make_model
from test_batching import together

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.generation import drafting as drafting_module
from kvboost_rag.core.generation.runner import Runner
from kvboost_rag.core.generation.sampler import Sampler
from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.generation.speculation import PromptLookup
from kvboost_rag.core.model.quantized import ROW_COUNTS, quantize

# Tiny random models repeat themselves within a few tokens: drafts are found and kept.
WORK = [
    (f"Report {i}: the {'north ' * (i % 3)}depot ships crates. Which depot?", 10 + 7 * i)
    for i in range(6)
]


def engine(arch: str, tokenizer: Any, drafts: int, **config: Any) -> KVBoost:
    config = KVBoostConfig(block_tokens=8, draft_tokens=drafts, **config)
    return KVBoost(make_model(arch), tokenizer, config)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_output_is_the_same_with_and_without_drafts(arch: str, tokenizer: Any) -> None:
    plain, drafting = engine(arch, tokenizer, 0), engine(arch, tokenizer, 8)
    want = [plain.generate(q, max_new_tokens=n).token_ids for q, n in WORK]
    assert [drafting.generate(q, max_new_tokens=n).token_ids for q, n in WORK] == want
    steps = drafting.stats().batch
    assert steps is not None and steps.steps < sum(map(len, want)) - len(want)  # drafts kept
    before = drafting.stats().batch.rows  # type: ignore[union-attr]
    batched = together([lambda w=w: drafting.generate(w[0], max_new_tokens=w[1]) for w in WORK])
    assert [r.token_ids for r in batched] == want
    after = drafting.stats().batch
    assert after is not None and after.peak > 1
    # rows decoding together verify drafts too: fewer row-steps than tokens after the first
    assert after.rows - before < sum(map(len, want)) - len(want)


def test_a_request_turns_drafting_off_or_on(tokenizer: Any) -> None:
    drafting = engine("llama", tokenizer, 8)
    before = drafting.stats().batch.steps  # type: ignore[union-attr]
    off = drafting.generate(WORK[3][0], max_new_tokens=30, draft_tokens=0)
    middle = drafting.stats().batch.steps  # type: ignore[union-attr]
    on = drafting.generate(WORK[3][0], max_new_tokens=30)
    after = drafting.stats().batch.steps  # type: ignore[union-attr]
    assert off.token_ids == on.token_ids
    assert middle - before == len(off.token_ids) - 1 > after - middle
    with pytest.raises(ValueError, match="draft_tokens"):
        drafting.generate("x", draft_tokens=-1)
    with pytest.raises(ValueError, match="draft_tokens"):
        KVBoostConfig(draft_tokens=True)  # type: ignore[arg-type]


def test_stop_strings_end_the_answer_inside_a_draft(tokenizer: Any) -> None:
    plain, drafting = engine("llama", tokenizer, 0), engine("llama", tokenizer, 8)
    free = plain.generate(WORK[4][0], max_new_tokens=40).text
    stop = free[12:14]
    want = plain.generate(WORK[4][0], max_new_tokens=40, stop=stop)
    got = drafting.generate(WORK[4][0], max_new_tokens=40, stop=stop)
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert got.finish_reason == want.finish_reason == "stop" and len(got.text) <= 12


def test_the_length_limit_holds_mid_draft(tokenizer: Any) -> None:
    drafting = engine("llama", tokenizer, 16)
    for n in (1, 2, 5, 9):
        assert len(drafting.generate(WORK[2][0], max_new_tokens=n).token_ids) == n


def test_cancelling_mid_draft_keeps_what_was_yielded(tokenizer: Any) -> None:
    drafting = engine("llama", tokenizer, 8)
    stream = drafting.stream(WORK[5][0], max_new_tokens=200)
    seen = []
    for delta in stream:
        seen.append(delta)
        if len(seen) == 3:
            break
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert stream.result.text == "".join(seen)
    assert drafting.generate(WORK[0][0], max_new_tokens=5).finish_reason == "length"


def test_constrained_answers_stay_valid_with_drafts(tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"depot": {"type": "string"}, "crates": {"type": "integer"}},
        "required": ["depot", "crates"],
    }
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    plain, drafting = engine("llama", tokenizer, 0), engine("llama", tokenizer, 8)
    messages = [{"role": "user", "content": 'Answer in JSON like {"depot": "north"}.'}]
    want = plain.chat(messages, response_format=fmt, max_new_tokens=60)
    got = drafting.chat(messages, response_format=fmt, max_new_tokens=60)
    assert got.token_ids == want.token_ids
    if got.finish_reason == "stop":
        assert set(json.loads(got.text)) == {"depot", "crates"}


def test_prompt_lookup_drafts_what_followed_the_latest_occurrence() -> None:
    lookup = PromptLookup([5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6], max_draft=3)
    assert lookup.draft(10) == [1, 2, 5]  # the latest (5, 6) was followed by 1, 2
    assert lookup.draft(2) == [1, 2]
    lookup.extend([1])
    assert lookup.draft(10) == [2, 5, 6]  # (6, 1) occurred once, then 2
    assert PromptLookup([1, 2, 3], 8).draft(5) == []  # (3), (2, 3), (1, 2, 3): never before


def test_a_draft_after_a_miss_is_as_long_as_before() -> None:
    """A step verifying 9 tokens costs about what 1 does: a miss does not shorten the
    next draft."""
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2], max_draft=8)
    assert lookup.draft(20) == [3, 4, 5, 6, 7, 8, 9, 10]
    lookup.judged(3, 40)  # the model chose 40 where the draft said 3
    lookup.extend([40, 1, 2])
    assert lookup.draft(20) == [40, 1, 2]  # what followed (1, 2) last time: all there is
    lookup.extend([3])
    assert lookup.draft(20) == [4, 5, 6, 7, 8, 9, 10, 1]


def test_hits_follow_how_often_a_drafts_first_token_is_chosen() -> None:
    lookup = PromptLookup([1, 2, 3], max_draft=8)
    assert lookup.hits == 1.0
    lookup.judged(4, 5)
    lookup.judged(4, 5)
    assert lookup.hits == pytest.approx(0.49)
    lookup.judged(7, 7)
    assert lookup.hits == pytest.approx(0.7 * 0.49 + 0.3)


def test_worth_counts_what_drafts_kept_fed_or_not_by_their_ngram() -> None:
    """Each draft, fed or not, is judged by the tokens that followed: the prefix it guessed
    counts toward the ``worth`` of drafts matched on as long an n-gram."""
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], max_draft=4)
    assert lookup.worth == 0.0  # no draft yet
    assert lookup.draft(10) == [3, 4, 5, 6] and lookup.matched == 2  # (1, 2) -> 3
    assert lookup.worth == pytest.approx(2.0)  # before any was judged: half a draft
    lookup.extend([3, 4])  # agrees so far: still open
    assert lookup.worth == pytest.approx(2.0)
    lookup.extend([5, 6])  # all four seen and right
    assert lookup.worth == pytest.approx(0.7 * 2 + 0.3 * 4)
    assert lookup.draft(10) == [7, 8, 9, 1] and lookup.matched == 3  # (4, 5, 6) -> 7
    assert lookup.worth == pytest.approx(2.0)  # 3-gram drafts: none judged yet
    lookup.extend([0])  # wrong at once: 0 kept
    assert lookup.worth == pytest.approx(0.7 * 2)
    assert lookup.draft(10) == [] and lookup.worth == 0.0  # (5, 6, 0), (6, 0), (0): new
    lookup.extend([1, 2])
    assert lookup.draft(10) == [3, 4, 5, 6] and lookup.worth == pytest.approx(2.6)


@pytest.mark.parametrize("cost", [0.0, 10.0])
def test_a_batch_feeds_drafts_only_while_they_pay(
    cost: float, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows decoding together feed their drafts while their hit rate pays for the wider
    forward (``DRAFT_COST_PER_ROW``): at no cost always, at a cost no hit rate reaches
    never; a lone row always does. Answers are the same either way."""
    monkeypatch.setattr(drafting_module, "DRAFT_COST_PER_ROW", cost)
    plain, drafting = engine("llama", tokenizer, 0), engine("llama", tokenizer, 8)
    want = [plain.generate(q, max_new_tokens=n).token_ids for q, n in WORK]
    fed: list[int] = []  # the most tokens a row was fed, in forwards of several rows
    run_rows = Runner.run_rows

    def recording(self: Runner, rows: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        if len(rows) > 1:
            fed.append(max(map(len, tokens)))
        return run_rows(self, rows, tokens, *args, **kwargs)

    monkeypatch.setattr(Runner, "run_rows", recording)
    batched = together([lambda w=w: drafting.generate(w[0], max_new_tokens=w[1]) for w in WORK])
    assert [r.token_ids for r in batched] == want
    assert fed, "no step decoded several rows"
    assert max(fed) > 1 if cost == 0 else max(fed) == 1
    lone = drafting.stats().batch.steps  # type: ignore[union-attr]
    drafting.generate(WORK[3][0], max_new_tokens=30)
    assert drafting.stats().batch.steps - lone < 29  # type: ignore[union-attr]


@pytest.mark.parametrize("cost", [1.0, 100.0])
def test_a_lone_row_on_quantized_weights_feeds_drafts_only_while_they_pay(
    cost: float, tokenizer: Any
) -> None:
    """Quantized kernels' time grows with the rows (``model/quantized.py``): a lone row
    feeds its draft while its ``worth + 1`` is at least the draft's rows' measured cost
    over one row's: at a cost of 1 (what dense weights cost) always, at 100 never. The
    answer is the same either way."""
    model = make_model("llama")
    layers = quantize(model, "int8")
    for layer in layers:
        layer.costs = {n: 1.0 if n == 1 else cost for n in ROW_COUNTS}
    config = KVBoostConfig(block_tokens=8, draft_tokens=8)
    plain = KVBoost(model, tokenizer, KVBoostConfig(block_tokens=8, draft_tokens=0))
    drafting = KVBoost(model, tokenizer, config)
    prompt, n = WORK[3][0], 30
    want = plain.generate(prompt, max_new_tokens=n).token_ids
    before = drafting.stats().batch.steps  # type: ignore[union-attr]  (one executor)
    assert drafting.generate(prompt, max_new_tokens=n).token_ids == want
    steps = drafting.stats().batch.steps - before  # type: ignore[union-attr]
    assert steps < n - 1 if cost == 1.0 else steps == n - 1


def test_speculative_sampling_keeps_the_distribution(tokenizer: Any) -> None:
    """Sampling a token after a draft: how often each token comes out must match the
    processed distribution a token is drawn from without a draft. A chi-square test over
    4,000 draws per proposal (one the model likes, one it does not) at the 0.1% level."""
    model = make_model("llama")
    options = SamplingOptions(temperature=0.8, top_k=12, seed=3)
    sampler = Sampler(model, tokenizer, options, 4, 50, threading.Event())
    torch.manual_seed(0)
    logits = torch.randn(2, model.config.vocab_size) * 2
    probs = torch.softmax(sampler._scores([1, 2, 3, 4], logits[0]), dim=-1)[0]
    likely, unlikely = int(probs.argmax()), int(probs.argsort()[-6])
    for proposed in (likely, unlikely):
        counts = Counter(
            sampler.verify([1, 2, 3, 4], logits, [proposed])[0][0] for _ in range(4000)
        )
        support = [int(t) for t in torch.nonzero(probs > 0)]
        assert set(counts) <= set(support)
        chi2 = sum(
            (counts[t] - 4000 * float(probs[t])) ** 2 / (4000 * float(probs[t])) for t in support
        )
        assert chi2 < _chi2_critical(len(support) - 1), (proposed, chi2)


def test_the_ids_processors_read_are_the_tokens_given(tokenizer: Any) -> None:
    """The sampler keeps one id tensor and extends it as a request's tokens grow; whatever
    it is given (an extension, the same, a prefix, other tokens, more than its room), the
    processors and stopping criteria read exactly those tokens."""
    sampler = Sampler(make_model("llama"), tokenizer, SamplingOptions(), 3, 4, threading.Event())
    calls = [
        [5, 6, 7],
        [5, 6, 7, 8],
        [5, 6, 7, 8, 9, 10],
        [5, 6, 7, 8, 9, 10],
        [5, 6, 7],  # a prefix of what it holds
        [5, 6, 11, 12],  # not an extension
        [5, 6, 11, 12, 13],
        list(range(40)),  # past max_length's room (a caller, not a request)
        [5],
    ]
    for tokens in calls:
        ids = sampler.input_ids(tokens)
        assert ids.tolist() == [tokens], tokens


def _chi2_critical(dof: int) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
