"""The repair strategies' choices: what the question reads (query, passage), how far values
moved (deviation), the probe beside SDPA, each level's probe depth."""

import pytest
import torch
from conftest import make_model
from reuse_setup import DOCS, assembled, engine_with

from kvboost_rag import KVBoostConfig
from kvboost_rag.core.model.attention import NAME
from kvboost_rag.core.reuse.repair import STRATEGIES, get_strategy


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
