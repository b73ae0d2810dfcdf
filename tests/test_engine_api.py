"""Generation behaviour users rely on: streaming, stop strings, threads, bad input."""

import threading

import pytest
from conftest import make_model

from kvboost_rag import (
    ContextWindowError,
    EmptyPromptError,
    KVBoost,
    KVBoostConfig,
    UnknownModelError,
)

PROMPT = "Once upon a time in a land far away, "


@pytest.fixture
def llama(tokenizer) -> KVBoost:
    return KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8))


def test_stream_deltas_join_to_the_generated_text(llama: KVBoost) -> None:
    expected = llama.generate(PROMPT, max_new_tokens=16)
    stream = llama.stream(PROMPT, max_new_tokens=16)
    deltas = list(stream)
    assert "".join(deltas) == expected.text == stream.result.text
    assert stream.result.token_ids == expected.token_ids
    assert stream.result.reused_tokens > 0  # the first call's prompt was cached


def test_stop_string_ends_text_before_it(llama: KVBoost) -> None:
    full = llama.generate(PROMPT, max_new_tokens=24)
    stop = full.text[5:8]
    assert stop and full.text.find(stop) >= 0
    result = llama.generate(PROMPT, max_new_tokens=24, stop=[stop])
    assert result.text == full.text[: full.text.find(stop)]
    assert result.finish_reason == "stop"
    assert len(result.token_ids) < 24
    streamed = llama.stream(PROMPT, max_new_tokens=24, stop=stop)
    deltas = list(streamed)
    assert "".join(deltas) == result.text and all(stop not in d for d in deltas)


def test_length_finish_reason(llama: KVBoost) -> None:
    result = llama.generate(PROMPT, max_new_tokens=3)
    assert (len(result.token_ids), result.finish_reason) == (3, "length")


def test_breaking_out_of_a_stream_cancels_and_frees_the_engine(llama: KVBoost) -> None:
    stream = llama.stream(PROMPT, max_new_tokens=400)
    for _ in stream:
        break
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert len(stream.result.token_ids) < 400
    assert llama.generate(PROMPT, max_new_tokens=2).finish_reason == "length"


def test_concurrent_callers_get_serial_results(llama: KVBoost, tokenizer) -> None:
    prompts = [f"{i}: {PROMPT * (i + 1)}" for i in range(6)]
    serial = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8))
    expected = [serial.generate(p, max_new_tokens=8).token_ids for p in prompts]
    results: dict[int, list[int]] = {}

    def work(i: int) -> None:
        results[i] = llama.generate(prompts[i], max_new_tokens=8).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))] * 1
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == expected


def test_stats_count_requests_hits_and_reuse(llama: KVBoost) -> None:
    llama.generate(PROMPT, max_new_tokens=2)
    second = llama.generate(PROMPT + "and", max_new_tokens=2)
    stats = llama.stats()
    assert stats.requests == 2 and stats.reused_tokens == second.reused_tokens > 0
    assert stats.cache.hits >= second.reused_tokens // 8 and stats.cache.entries > 0
    assert 0 < second.kv_reuse_ratio < 1


def test_empty_prompt_and_messages(llama: KVBoost) -> None:
    with pytest.raises(EmptyPromptError, match="prompt is empty"):
        llama.generate("")
    with pytest.raises(EmptyPromptError, match="messages is empty"):
        llama.chat([])
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
        llama.chat([{"text": "hi"}])
    with pytest.raises(TypeError, match="prompt must be a str"):
        llama.generate(["hi"])  # type: ignore[arg-type]


def test_prompt_over_the_context_window_names_both_lengths(llama: KVBoost) -> None:
    with pytest.raises(ContextWindowError, match="prompt is 600 tokens .* context window is 512"):
        llama.generate("x" * 600)
    with pytest.raises(ContextWindowError):
        llama.stream("x" * 600)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"stop": [""]}, "stop must be non-empty strings"),
        ({"seed": "x"}, "seed must be an int"),
    ],
)
def test_invalid_sampling_values(llama: KVBoost, option: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama.generate(PROMPT, **option)


def test_unknown_option_is_rejected(llama: KVBoost) -> None:
    with pytest.raises(TypeError, match="frequency_penalty"):
        llama.generate(PROMPT, frequency_penalty=1.0)


def test_unknown_model_alias() -> None:
    with pytest.raises(UnknownModelError, match="unknown model 'smollm9'"):
        KVBoost.from_pretrained("smollm9")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fidelity": "perfect"}, "fidelity must be one of"),
        ({"block_tokens": 0}, "block_tokens must be in"),
        ({"max_cache_bytes": -1}, "max_cache_bytes must be >= 0"),
    ],
)
def test_invalid_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVBoostConfig(**kwargs)
