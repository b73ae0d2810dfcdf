"""Property-based fuzzing (hypothesis) of the engine's public requests: under any
arguments (sampling values of any type, NaN, inf, huge; empty, None and non-string
documents; messages of every role and shape; stop lists with empty strings), a call either
returns a well-formed answer or raises a ``ValueError`` / ``TypeError`` from the package's
own code, never a traceback from inside torch, transformers or tokenizers. Examples per
property: 40 always; HYPOTHESIS_PROFILE=thorough runs 2,000. Valid calls decode at most 4
tokens on a tiny random Llama (``fuzzing.fuzz_engine``). The adapters: ``test_fuzz_adapters``."""

from __future__ import annotations

import pytest
from conftest import run_thorough
from fuzzing import (
    FORM,
    MESSAGES,
    PASSAGES,
    PROMPT,
    SAMPLING,
    TOOL,
    attempt,
    check_result,
    consume,
    fuzz_engine,
)
from hypothesis import given
from hypothesis import strategies as st

from kvboost_rag import KVBoost


@pytest.fixture(scope="module")
def engine() -> KVBoost:
    return fuzz_engine()


# -- the engine ---------------------------------------------------------------------------


@given(prompt=PROMPT, passages=PASSAGES, sampled=SAMPLING, stream=st.booleans())
def test_generate_and_stream_answer_or_refuse_clearly(
    engine, prompt, passages, sampled, stream
) -> None:
    options, refused = sampled
    if stream:
        got = attempt(lambda: consume(engine.stream(prompt, passages=passages, **options)))
    else:
        got = attempt(lambda: ([], engine.generate(prompt, passages=passages, **options)))
    assert got is None or not refused, f"accepted {options}"
    if got is not None:
        deltas, result = got
        check_result(result, options, engine.context_window)
        assert not stream or "".join(deltas) == result.text


@given(messages=MESSAGES, form=FORM, sampled=SAMPLING, stream=st.booleans())
def test_chat_and_stream_chat_answer_or_refuse_clearly(
    engine, messages, form, sampled, stream
) -> None:
    options, refused = sampled
    if stream:
        got = attempt(lambda: consume(engine.stream_chat(messages, **form, **options)))
    else:
        got = attempt(lambda: ([], engine.chat(messages, **form, **options)))
    assert got is None or not refused, f"accepted {options}"
    if got is not None:
        deltas, result = got
        check_result(result, options, engine.context_window)
        assert result.tool_calls == [] or form.get("tools") == [TOOL]
        if stream and not form.get("tools"):  # with tools, a call being written is held back
            assert "".join(deltas) == result.text


# -- what the fuzzing found on the request path, past SamplingOptions' checks --------------


def test_stop_string_the_tokenizer_cannot_spell(engine) -> None:
    # The test tokenizer has printable ASCII only; a byte-level one spells any text.
    with pytest.raises(ValueError, match="cannot be written with this tokenizer"):
        engine.generate("Once", max_new_tokens=2, stop=["\u00e9"])
    assert engine.generate("Once", max_new_tokens=2, stop=["\u00e9", "x"]).text is not None


@pytest.mark.slow
def test_every_property_holds_over_2000_examples() -> None:
    run_thorough(__file__, 3)
