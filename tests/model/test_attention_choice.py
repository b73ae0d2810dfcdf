"""``attention_choice``: the decoding steps' attention form is timed once at the model's
shape and kept with the machine's measurements; the engine's rows carry the verdict."""

from __future__ import annotations

import torch
from conftest import make_model

from kvboost_rag.core.model import attention_choice
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.measurements import Measurements


def test_the_verdict_is_timed_once_then_recalled(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = make_model("llama")
    attention = model_support(model).attention
    measurements = Measurements(tmp_path)
    timed: list[tuple[int, int, int]] = []
    real = attention_choice.faster

    def counting(shape, dtype):  # type: ignore[no-untyped-def]
        timed.append(shape)
        return real(shape, dtype)

    monkeypatch.setattr(attention_choice, "faster", counting)
    first = attention_choice.few_queries(model, attention, measurements)
    config = model.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    assert timed == [(heads, kv, config.hidden_size // heads)]
    assert attention_choice.few_queries(model, attention, measurements) is first
    assert len(timed) == 1  # recalled, not timed again
    assert list(tmp_path.rglob("*.json"))  # kept on disk for the next start
    # a model of another dtype is another measurement
    attention_choice.few_queries(model.to(torch.bfloat16), attention, measurements)
    assert len(timed) == 2


def test_the_verdict_follows_the_timings(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Whichever form is made slow loses: the verdict is the timing, not a default."""
    real = attention_choice.few_query_attention
    monkeypatch.setattr(attention_choice, "few_query_attention", _slowed(real))
    assert attention_choice.faster((6, 2, 16), torch.float32) is False
    monkeypatch.setattr(attention_choice, "few_query_attention", real)
    sdpa = attention_choice.sdpa_attention_forward
    monkeypatch.setattr(attention_choice, "sdpa_attention_forward", _slowed(sdpa))
    monkeypatch.setattr(
        attention_choice.F, "scaled_dot_product_attention",
        _slowed(attention_choice.F.scaled_dot_product_attention),
    )  # fmt: skip
    assert attention_choice.faster((6, 2, 16), torch.float32) is True


def _slowed(fn):  # type: ignore[no-untyped-def]
    import time

    def slowed(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.005)
        return fn(*args, **kwargs)

    return slowed


def test_the_engines_rows_carry_the_verdict(monkeypatch, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from kvboost_rag import KVBoost, KVBoostConfig
    from kvboost_rag.core.model import attention as attention_module

    seen: list[bool] = []
    original = attention_module.attention

    def spying(module, query, key, value, mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        forward = kwargs.get(attention_module.KEYWORD)
        if forward is not None and forward.rows:
            seen.append(forward.few)
        return original(module, query, key, value, mask, *args, **kwargs)

    monkeypatch.setattr(attention_module, "attention", spying)
    for verdict in (True, False):
        monkeypatch.setattr(attention_choice, "faster", lambda shape, dtype, v=verdict: v)
        seen.clear()
        model = make_model("llama")
        engine = KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))
        engine.generate("one two three", max_new_tokens=3)
        assert seen and set(seen) == {verdict}
