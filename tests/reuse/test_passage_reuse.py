"""Position-independent passage reuse: re-rotation, repair and the engine path."""

import pytest
import torch
from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model.attention import NAME
from kvboost_rag.core.model.rope import rerotate, rotary_embedding, rotation
from kvboost_rag.core.prompt.chunker import passage
from kvboost_rag.core.reuse.repair import STRATEGIES, get_strategy

DOCS = [
    "Paris is the capital of France and sits on the Seine.",
    "The Nile flows north through Egypt into the Mediterranean.",
    "Mount Fuji is the highest mountain in Japan.",
]
QUESTION = "Question: which river flows north? Answer:"


class TensorRow:
    """A KV row over plain tensors (what the executor's rows are to a context build)."""

    def __init__(self, like: list, length: int) -> None:
        k = like[0][0][0]
        shape = (1, k.shape[1], length, k.shape[-1])
        self.kv = [(k.new_zeros(shape), k.new_zeros(shape)) for _ in like[0]]
        self.length = 0

    def write(self, start: int, kv: list) -> None:
        n = kv[0][0].shape[-2]
        for (k, v), (nk, nv) in zip(self.kv, kv):
            k[:, :, start : start + n], v[:, :, start : start + n] = nk, nv
        self.length = max(self.length, start + n)

    def zero(self, start: int, end: int) -> None:
        for k, v in self.kv:
            k[:, :, start:end] = v[:, :, start:end] = 0

    def views(self, start: int, end: int) -> list:
        return [(k[:, :, start:end], v[:, :, start:end]) for k, v in self.kv]


def engine_with(arch: str, tokenizer, **config) -> KVBoost:
    return KVBoost(make_model(arch), tokenizer, KVBoostConfig(block_tokens=8, **config))


def full_logits(engine: KVBoost, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(torch.tensor([tokens])).logits[0, -1]


def test_rerotated_keys_equal_a_fresh_encode_at_the_new_offset(arch: str, tokenizer) -> None:
    engine = engine_with(arch, tokenizer)
    cache = engine.inspect.passage_cache
    tokens = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    ((_, stored),) = cache.encoder.encode(cache.anchor, [tokens])
    delta, a = 37, len(cache.anchor)
    ids = torch.tensor([[*cache.anchor, *tokens]])
    with torch.no_grad():
        out = engine.model(ids, position_ids=torch.arange(delta, delta + ids.shape[1])[None])
    rot = rotation(delta, rotary_embedding(engine.model), stored[0][0])
    for layer, (keys, values) in enumerate(stored):
        fresh = out.cache.layers[layer]
        torch.testing.assert_close(rerotate(keys, rot), fresh.keys[:, :, a:], atol=2e-5, rtol=0)
        torch.testing.assert_close(values, fresh.values[:, :, a:], atol=2e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["deviation", "query", "passage"])
def test_recomputing_every_token_equals_full_prefill(arch: str, tokenizer, strategy: str) -> None:
    engine = engine_with(arch, tokenizer, repair=strategy, recompute_ratio=1.0)
    engine.warm_passages(DOCS)
    prompt = "Context:\n" + passage(DOCS[2]) + "\n" + passage(DOCS[0]) + "\n" + QUESTION
    logits = engine.first_token_logits(prompt)
    torch.testing.assert_close(
        logits, full_logits(engine, engine.tokenize(prompt)), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}])
def test_full_recompute_decodes_like_generate(tokenizer, sampling: dict) -> None:
    """The repair pass picks the first token itself; it must pick what generate would."""
    engine = engine_with("llama", tokenizer, repair="deviation", recompute_ratio=1.0)
    prompt = passage(DOCS[0]) + passage(DOCS[1]) + QUESTION
    assert engine.warm_passages(prompt).new == 2
    result = engine.generate(prompt, max_new_tokens=8, seed=3, **sampling)
    assert result.passages_hit == 2 and result.timings.repair_ms > 0
    torch.manual_seed(3)
    ids = torch.tensor([engine.tokenize(prompt)])
    out = engine.model.generate(ids, max_new_tokens=8, do_sample=bool(sampling), **sampling)
    expected = out[0, ids.shape[1] :].tolist()
    assert result.token_ids == expected[: len(result.token_ids)]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20}])
def test_first_token_follows_the_model_generation_config(tokenizer, sampling: dict) -> None:
    """The first token after repair goes through the processors generate builds from the
    model's generation config (here a strong repetition penalty and min_p), as the rest do."""
    engine = engine_with("llama", tokenizer, repair="deviation", recompute_ratio=1.0)
    engine.model.generation_config.repetition_penalty = 50.0
    engine.model.generation_config.min_p = 0.2
    prompt = passage(DOCS[0]) + passage(DOCS[1]) + QUESTION
    engine.warm_passages(prompt)
    result = engine.generate(prompt, max_new_tokens=6, seed=5, **sampling)
    assert result.passages_hit == 2
    torch.manual_seed(5)
    ids = torch.tensor([engine.tokenize(prompt)])
    out = engine.model.generate(ids, max_new_tokens=6, do_sample=bool(sampling), **sampling)
    assert result.token_ids == out[0, ids.shape[1] :].tolist()[: len(result.token_ids)]
    penalized = engine.model.generate(ids, max_new_tokens=1, repetition_penalty=1.0)
    assert sampling or penalized[0, -1] != out[0, ids.shape[1]]  # the penalty mattered


def test_passage_right_after_bos_needs_no_repair(arch: str, tokenizer) -> None:
    engine = engine_with(arch, tokenizer, repair="none")
    prompt = "<s>" + passage(DOCS[1]) + QUESTION
    tokens = engine.tokenize(prompt)
    assert tokens[0] == tokenizer.bos_token_id == engine.inspect.passage_cache.anchor[0]
    torch.testing.assert_close(
        engine.first_token_logits(prompt), full_logits(engine, tokens), atol=1e-5, rtol=0
    )


def test_reordered_passages_are_all_hits(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, fidelity="fast", repair="edges", edge_tokens=4)
    first = engine.generate(QUESTION, passages=DOCS, max_new_tokens=4)
    assert (first.passages_hit, first.passages_missed) == (0, 3)
    second = engine.generate(QUESTION, passages=DOCS[::-1], max_new_tokens=4)
    assert (second.passages_hit, second.passages_missed) == (3, 0)
    passage_tokens = sum(len(tokenizer(d)["input_ids"]) for d in DOCS)
    edges = 3 * 4
    assert second.reused_tokens == passage_tokens - edges
    assert second.recomputed_tokens == second.prompt_tokens - second.reused_tokens
    assert second.timings.repair_ms > 0 and second.timings.encode_ms == 0


def test_answers_stay_close_to_full_prefill(tokenizer) -> None:
    """On a tiny random model balanced repair keeps the first-token distribution close."""
    engine = engine_with("llama", tokenizer, fidelity="balanced", recompute_ratio=0.5)
    engine.warm_passages(DOCS)
    prompt = "".join(passage(d) + "\n" for d in DOCS[::-1]) + QUESTION
    ours = torch.log_softmax(engine.first_token_logits(prompt), -1)
    ref = torch.log_softmax(full_logits(engine, engine.tokenize(prompt)), -1)
    none = engine_with("llama", tokenizer, repair="none")
    none.warm_passages(prompt)
    worse = torch.log_softmax(none.first_token_logits(prompt), -1)
    kl = lambda p, q: float((p.exp() * (p - q)).sum())  # noqa: E731
    assert kl(ref, ours) < kl(ref, worse)


def test_exact_fidelity_never_reuses_passages(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, fidelity="exact")
    engine.generate(QUESTION, passages=DOCS, max_new_tokens=2)
    result = engine.generate(QUESTION, passages=DOCS[::-1], max_new_tokens=2)
    assert result.passages_hit == result.passages_missed == 0
    with pytest.raises(ValueError, match="passage reuse is off"):
        engine.warm_passages(DOCS)


def test_prefix_cache_stops_at_the_first_reused_passage(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, fidelity="fast")
    system = "You answer questions about places. " * 2
    prompt = system + passage(DOCS[0]) + QUESTION
    engine.warm_passages(prompt)
    first = engine.generate(prompt, max_new_tokens=2)
    again = engine.generate(prompt, max_new_tokens=2)
    # Had the approximate KV after the passage entered the exact prefix cache, the repeat
    # would be served from it whole; instead only the system prompt is an exact prefix.
    assert first.passages_hit == again.passages_hit == 1
    system_tokens = len(engine.tokenize(system))
    assert again.reused_tokens - first.reused_tokens == system_tokens


def test_model_without_rope_falls_back_to_exact_reuse(tokenizer) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2))
    with pytest.warns(UserWarning, match="no rotary position embedding"):
        engine = KVBoost(model.eval(), tokenizer, KVBoostConfig(fidelity="balanced"))
    result = engine.generate(QUESTION, passages=DOCS, max_new_tokens=2)
    assert result.passages_missed == 0


def assembled(engine: KVBoost):
    """QUESTION over DOCS, every passage cached after the prompt's prefix and assembled
    unrepaired: the prompt and the ``RepairPlan`` a strategy sees."""
    from kvboost_rag.core.reuse.policy import ReusePolicy
    from kvboost_rag.core.reuse.repair import RepairPlan

    prompt = engine._prompts.text(QUESTION, DOCS)
    n = len(prompt.tokens) - 1
    cache = engine.inspect.passage_cache
    prefix = cache.prefix(prompt.tokens[: prompt.passages[0].offset])
    found = cache.fetch(prefix, [p.tokens for p in prompt.passages])
    row = TensorRow(found.kv, n)
    policy = ReusePolicy(engine._caches.reuse.policy.repair)
    placed = policy.plan(prompt.tokens, prompt.passages, 0, prefix, [prefix] * len(DOCS))
    engine._caches.reuse.assemble(placed, found, row)
    spans = [(p.start, p.end) for p in prompt.passages]
    plan = RepairPlan(prompt.tokens, n, 0, spans, row.views(0, n))
    return prompt, plan


def test_query_strategy_recomputes_what_the_question_reads(tokenizer) -> None:
    from kvboost_rag.core.reuse.repair import (
        RepairSettings,
        choose_query,
        question_attention,
    )

    engine = engine_with("llama", tokenizer)
    prompt, plan = assembled(engine)
    with torch.inference_mode():
        score = question_attention(engine._handle.engine_model, plan, 3)
        chosen = choose_query(
            plan, RepairSettings("query", 0, 0.1, None), engine._handle.engine_model
        )
    reused = [i for p in prompt.passages for i in range(p.start, p.end)]
    assert len(chosen) == round(0.1 * len(reused)) and set(chosen) <= set(reused)
    threshold = min(float(score[p]) for p in chosen)
    assert all(float(score[p]) <= threshold + 1e-6 for p in set(reused) - set(chosen))
    assert (
        engine._handle.engine_model.config._attn_implementation == NAME
    )  # restored after the probe


@pytest.mark.parametrize("mass", [0.05, 0.3, 1.0])
def test_query_strategy_with_a_mass_stops_once_the_chosen_hold_it(tokenizer, mass) -> None:
    """The adaptive ratio: the fewest top tokens whose question attention reaches ``mass``
    of what the reused tokens get, never more than ``recompute_ratio`` of them."""
    from kvboost_rag.core.reuse.repair import (
        RepairSettings,
        choose_query,
        question_attention,
    )

    engine = engine_with("llama", tokenizer)
    prompt, plan = assembled(engine)
    ratio = 0.5
    with torch.inference_mode():
        score = question_attention(engine._handle.engine_model, plan, 3)
        chosen = choose_query(
            plan, RepairSettings("query", 0, ratio, None, mass), engine._handle.engine_model
        )
    reused = [i for p in prompt.passages for i in range(p.start, p.end)]
    ranked = sorted(reused, key=lambda p: -float(score[p]))
    total = sum(float(score[p]) for p in reused)
    cap = round(ratio * len(reused))
    # the fewest leading tokens of the ranking that reach the mass, capped
    need = next(
        (
            k
            for k in range(1, len(ranked) + 1)
            if sum(float(score[p]) for p in ranked[:k]) >= mass * total
        ),
        len(ranked),
    )
    assert len(chosen) == min(need, cap)
    assert set(chosen) == set(ranked[: len(chosen)])
    assert (len(chosen) < cap) == (mass < 1.0)  # on a random model the mass is spread


def test_passage_strategy_recomputes_the_passage_the_question_reads(tokenizer) -> None:
    from kvboost_rag.core.reuse.repair import (
        RepairSettings,
        choose_passages,
        question_attention,
    )

    engine = engine_with("llama", tokenizer)
    prompt, plan = assembled(engine)
    with torch.inference_mode():
        score = question_attention(engine._handle.engine_model, plan, 3)
        one = choose_passages(
            plan, RepairSettings("passage", 0, 0.01, None), engine._handle.engine_model
        )
        none = choose_passages(
            plan, RepairSettings("passage", 0, 0.0, None), engine._handle.engine_model
        )
    best = max(prompt.passages, key=lambda p: float(score[p.start : p.end].mean()))
    assert one == list(range(best.start, best.end)) and none == []


def test_strategy_registry_lists_choices() -> None:
    assert {"none", "edges", "deviation", "query", "passage"} <= set(STRATEGIES)
    with pytest.raises(KeyError, match="choose one of"):
        get_strategy("magic")
    with pytest.raises(ValueError, match="repair must be one of"):
        KVBoostConfig(repair="magic")


@pytest.mark.parametrize(
    "settings",
    [{}, {"fidelity": "fast"}, {"fidelity": "exact"}, {"repair": "edges"}, {"repair": "passage"}],
)
def test_recompute_mass_is_refused_where_nothing_would_read_it(settings) -> None:
    with pytest.raises(ValueError, match="recompute_mass applies to the 'query' repair only"):
        KVBoostConfig(recompute_mass=0.5, **settings)
    with pytest.raises(ValueError, match=r"recompute_mass must be in \(0, 1\]"):
        KVBoostConfig(recompute_mass=1.5)
    config = KVBoostConfig(repair="query", recompute_mass=0.5)
    assert config.repair_settings().recompute_mass == 0.5


def test_passage_keys_depend_on_the_model(tokenizer) -> None:
    a = engine_with("llama", tokenizer).inspect.passage_cache
    b = engine_with("qwen2", tokenizer).inspect.passage_cache
    assert a.key(a.prefix([1]), [5, 6, 7]) != b.key(b.prefix([1]), [5, 6, 7])


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])
def test_the_probe_beside_sdpa_scores_what_eager_attention_weighs(arch: str, tokenizer) -> None:
    """The question probe takes its scores beside the forward's own SDPA: the same as the
    attention weights an eager forward returns, layer by layer."""
    from kvboost_rag.core.reuse.repair import question_attention

    engine = engine_with(arch, tokenizer)
    prompt, plan = assembled(engine)
    with torch.inference_mode():
        for layers in (1, 2):
            beside = question_attention(engine._handle.engine_model, plan, layers)
            engine._handle.engine_model.set_attn_implementation("eager")
            eager = question_attention(engine._handle.engine_model, plan, layers)
            engine._handle.engine_model.set_attn_implementation(NAME)
            torch.testing.assert_close(beside, eager, atol=1e-5, rtol=1e-5)


def test_a_levels_probe_depth_applies_to_its_own_strategy_only(monkeypatch, tokenizer) -> None:
    from kvboost_rag.core.reuse import repair

    assert KVBoostConfig().repair_settings() == repair.RepairSettings("shared", 4, 0.40, None)
    assert KVBoostConfig(repair="deviation").repair_settings().probe_layers is None  # its own 2
    assert KVBoostConfig(repair="deviation", probe_layers=3).repair_settings().probe_layers == 3
    # The question probe was measured at its own depth, not deviation's 2 layers.
    assert KVBoostConfig(repair="query").repair_settings().probe_layers is None
    assert KVBoostConfig(fidelity="fast", repair="query").repair_settings().probe_layers is None
    depths: list[int] = []
    monkeypatch.setattr(
        repair,
        "question_attention",
        lambda m, plan, layers: depths.append(layers) or torch.ones(plan.tail),
    )
    engine = engine_with("llama", tokenizer)
    _, plan = assembled(engine)
    for settings in (KVBoostConfig(repair="query"), KVBoostConfig(repair="query", probe_layers=1)):
        repair.choose_query(plan, settings.repair_settings(), engine.model)
    assert depths == [min(repair.QUERY_LAYERS, engine.model.config.num_hidden_layers), 1]


def test_deviation_ranks_reused_tokens_by_how_far_their_values_moved(tokenizer) -> None:
    """Exact cached KV except where the test moves it: values moved at the probed layer
    are chosen, largest first; keys moved (by far more) choose nothing."""
    from kvboost_rag.core.model.kv import to_cache
    from kvboost_rag.core.reuse.repair import RepairPlan, RepairSettings, choose_deviation

    model = make_model("llama")
    tokens = [tokenizer.bos_token_id, *tokenizer(DOCS[0] + " " + DOCS[1])["input_ids"]]
    cache = to_cache([], model.config)
    with torch.no_grad():
        model(torch.tensor([tokens]), cache=cache)
    exact = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    spans = [(3, len(tokens))]
    settings = RepairSettings("deviation", 0, 3 / (len(tokens) - 3), probe_layers=2)

    def chosen(moved: dict[tuple[int, int], float]) -> list[int]:
        kv = [(k.clone(), v.clone()) for k, v in exact]
        for (kind, position), by in moved.items():
            kv[1][kind][:, :, position] += by
        plan = RepairPlan(tokens, len(tokens), 1, spans, kv)
        with torch.no_grad():
            return choose_deviation(plan, settings, model)

    assert chosen({(1, 9): 1.0, (1, 4): 3.0, (1, 12): 2.0}) == [4, 12, 9]
    keys_only = chosen({(0, 5): 50.0, (0, 6): 50.0, (0, 7): 50.0, (1, 10): 0.5})
    assert keys_only[0] == 10 and not {5, 6, 7} & set(keys_only)
