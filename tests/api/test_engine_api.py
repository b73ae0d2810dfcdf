"""Generation behaviour users rely on: streaming, stop strings, threads, bad input."""

import threading

import numpy as np
import pytest
from conftest import make_model, make_tokenizer

from kvboost_rag import (
    ContextWindowError,
    EmptyPromptError,
    KVBoost,
    KVBoostConfig,
    UnknownModelError,
    passage,
)
from kvboost_rag.core.prompt.prompts import ChatTemplateError

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


def test_a_finished_stream_iterated_again_yields_nothing(llama: KVBoost) -> None:
    """A new user's hang: the second pass over a finished stream waited forever."""
    stream = llama.stream("Twice:", max_new_tokens=6)
    first = "".join(stream)
    assert first and "".join(stream) == "" and list(stream) == []
    assert stream.result is not None and stream.result.text == first
    stream.close()  # and closing an ended stream is harmless


def test_a_stream_left_early_keeps_what_it_yielded(llama: KVBoost) -> None:
    stream = llama.stream(PROMPT, max_new_tokens=60)
    seen = []
    for delta in stream:
        seen.append(delta)
        if len(seen) == 4:
            break
    assert stream.result is not None and stream.result.text == "".join(seen)
    assert llama.tokenizer.decode(stream.result.token_ids).startswith("".join(seen))


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


def test_a_stop_set_s_matcher_is_built_once(
    llama: KVBoost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building one reads the whole vocabulary (0.5-1 s a request on Qwen2.5's): it was
    built twice per answer, once to check the stops and once by the sampler."""
    from transformers import StopStringCriteria

    built: list[list[str]] = []
    real = StopStringCriteria.__init__

    def counted(self: StopStringCriteria, tokenizer: object, stop_strings: list[str]) -> None:
        built.append(list(stop_strings))
        real(self, tokenizer, stop_strings)

    monkeypatch.setattr(StopStringCriteria, "__init__", counted)
    full = llama.generate(PROMPT, max_new_tokens=24)
    stop = full.text[5:8]
    for _ in range(3):
        result = llama.generate(PROMPT, max_new_tokens=24, stop=[stop])
        assert result.text == full.text[: full.text.find(stop)]
    assert list(llama.stream(PROMPT, max_new_tokens=24, stop=stop)) and built == [[stop]]
    llama.generate(PROMPT, max_new_tokens=4, stop=[stop, "zz"])
    assert built == [[stop], [stop, "zz"]]


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


def test_after_a_break_the_result_holds_what_was_yielded(llama: KVBoost) -> None:
    stream = llama.stream(PROMPT, max_new_tokens=400)
    yielded = []
    for piece in stream:
        yielded.append(piece)
        if len(yielded) == 3:
            break
    assert stream.result is not None and stream.result.text == "".join(yielded)
    assert len(stream.result.token_ids) >= 3


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


@pytest.mark.parametrize("blank", [" ", "   \n\t ", "\u3000\u00a0"])
def test_whitespace_only_prompts_are_empty_prompts(llama: KVBoost, blank: str) -> None:
    """generate("   \n\t ") answered from 3 tokens while "" was refused."""
    calls = [
        lambda: llama.generate(blank),
        lambda: list(llama.stream(blank)),
        lambda: llama.warm(blank),
        lambda: llama.generate(blank, passages=[blank, ""]),
        lambda: llama.generate(passage(blank) + blank),
        lambda: llama.chat([{"role": "user", "content": blank}]),
        lambda: list(
            llama.stream_chat(
                [{"role": "system", "content": ""}, {"role": "user", "content": blank}]
            )
        ),
        lambda: llama.first_token_logits(blank),
    ]
    for call in calls:
        with pytest.raises(EmptyPromptError, match="empty|only whitespace"):
            call()
    assert llama.stats().requests == 0
    # Whitespace around real text, or beside a passage, is a prompt.
    assert llama.generate(blank, passages=["Alpha."], max_new_tokens=1).completion_tokens == 1
    assert (
        llama.chat([{"role": "user", "content": blank + "hi"}], max_new_tokens=1).text is not None
    )


def test_an_adapter_option_name_is_named_with_the_engines(llama: KVBoost) -> None:
    """generate(q, max_tokens=8) raised "SamplingOptions.__init__() got an unexpected
    keyword argument": a class the caller never met."""
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['max_tokens'\]") as caught:
        llama.generate(PROMPT, max_tokens=8)
    assert "(max_tokens= is max_new_tokens= here)" in str(caught.value)
    assert "SamplingOptions" not in str(caught.value)


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


# Found by tests/api/test_fuzz_api.py: each was accepted, misread, or failed inside torch,
# transformers, jinja or json instead of raising the package's own error.
@pytest.mark.parametrize(
    "option, message",
    [
        ({"max_new_tokens": True}, "max_new_tokens must be an int >= 1, got True"),  # was 1
        ({"temperature": True}, "temperature must be >= 0"),  # was 1.0
        ({"top_k": True, "temperature": 0.5}, "top_k must be an int"),  # torch.topk TypeError
        ({"seed": True}, "seed must be an int"),  # was seed 1
        ({"temperature": float("inf")}, "a finite number; got inf"),  # was uniform sampling
        ({"top_p": float("nan")}, "a finite number; got nan"),
        ({"temperature": "0.7"}, "temperature must be"),  # was "'>=' not supported between"
        ({"top_p": None}, "top_p must be"),
        ({"seed": 2**64}, r"seed must be an int in \[0, 2\*\*64 - 1\]"),  # torch's overflow
        ({"seed": -1}, "seed must be an int"),  # -1 is no "random seed" here
        ({"stop": {"a": 1}}, "stop must be a str, a list of str or None, got dict"),  # was "a"
        ({"stop": 5}, "stop must be a str"),  # was "'int' object is not iterable"
        ({"stop": ["\ud800"]}, "lone surrogate"),  # UnicodeEncodeError inside transformers
        ({"constrain": "no"}, "constrain must be True or False"),  # "no" constrained decoding
    ],
)
def test_odd_sampling_and_form_values(llama: KVBoost, option: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama.generate(PROMPT, **{"max_new_tokens": 2, **option})


def test_a_tiny_temperature_decodes_greedily(llama: KVBoost) -> None:
    # logits / 1e-300 overflowed to NaN probabilities: a RuntimeError inside torch.multinomial
    greedy = llama.generate(PROMPT, max_new_tokens=3)
    tiny = llama.generate(PROMPT, max_new_tokens=3, temperature=1e-300, seed=1)
    assert tiny.token_ids == greedy.token_ids


def test_numpy_scalars_and_the_largest_seed_are_taken(llama: KVBoost) -> None:
    # np.float32 passed validation, then transformers refused it ("strictly positive float")
    result = llama.generate(PROMPT, max_new_tokens=np.int64(2), temperature=np.float32(0.5))
    assert len(result.token_ids) == 2
    assert len(llama.generate(PROMPT, max_new_tokens=2, temperature=0.7, seed=2**64 - 1).token_ids)


def test_huge_max_new_tokens_ends_at_the_context_window(llama: KVBoost) -> None:
    result = llama.generate("x" * 508, max_new_tokens=10**30)
    assert result.prompt_tokens + len(result.token_ids) <= llama.context_window == 512


@pytest.mark.parametrize(
    "passages, message",
    [
        ("abc", "passages must be a list of str, got str"),  # was three one-letter passages
        (["ok", 5], r"passages\[1\] is a int"),  # was "argument of type 'int' is not iterable"
        ([b"x"], r"passages\[0\] is a bytes"),
    ],
)
def test_passages_that_are_not_a_list_of_str(llama: KVBoost, passages, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        llama.generate("q", passages=passages, max_new_tokens=1)


def test_a_lone_surrogate_is_refused_before_the_tokenizer(llama: KVBoost) -> None:
    # was a TypeError from inside transformers ("TextEncodeInput must be Union[...]")
    with pytest.raises(ValueError, match=r"lone surrogate '\\ud800' at character 1"):
        llama.generate("a\ud800b", max_new_tokens=1)
    with pytest.raises(ValueError, match="lone surrogate"):
        llama.chat([{"role": "user", "content": "\udfff"}], max_new_tokens=1)


@pytest.mark.parametrize(
    "message, text",
    [  # list content was rendered as its Python repr, int content as digits
        ({"role": "user", "content": [{"type": "text", "text": "hi"}]}, "got list; join"),
        ({"role": "user", "content": 5}, r"\['content'\] must be a str \(or None\), got int"),
        ({"role": None, "content": "hi"}, r"\['role'\] must be a non-empty str, got None"),
        ({"role": "assistant", "tool_calls": "lookup"}, r"\['tool_calls'\] must be a list"),
        (  # was a JSONDecodeError from inside the json module
            {"role": "assistant", "tool_calls": [{"name": "lookup", "arguments": "{bad"}]},
            "arguments are not JSON",
        ),
        (  # was AttributeError: 'int' object has no attribute 'get'
            {"role": "assistant", "tool_calls": [{"function": 5}]},
            "a tool call needs a str name",
        ),
    ],
)
def test_messages_of_the_wrong_shape(llama: KVBoost, message: dict, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        llama.chat([message], max_new_tokens=1)


def test_a_chat_template_refusal_is_a_chat_template_error() -> None:
    refusing = make_tokenizer()
    refusing.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}{{ m['content'] }}"
        "{% endfor %}"
    )
    engine = KVBoost(make_model("llama"), refusing, KVBoostConfig(block_tokens=8))
    # was jinja2's TemplateError from inside transformers, which is no ValueError
    with pytest.raises(ChatTemplateError, match="refused these messages: Unknown role: wizard"):
        engine.chat([{"role": "wizard", "content": "hi"}], max_new_tokens=1)
