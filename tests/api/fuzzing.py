"""What the fuzzing modules share (``test_fuzz_api``: the engine's requests;
``test_fuzz_adapters``: both adapters, blank input everywhere, the splitters;
``test_fuzz_loading``): the property every call must hold, the strategies that build
the engine's arguments, and the tiny engine they are served from."""

from __future__ import annotations

import signal
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from conftest import assert_clear, make_model, make_tokenizer
from hypothesis import event
from hypothesis import strategies as st

from kvboost_rag import GenerationResult, KVBoost, KVBoostConfig, passage

# -- the property -------------------------------------------------------------------------

FINISH = {"stop", "length", "tool_calls"}
MAX_NEW = 4  # the most tokens a valid call here decodes


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: float = 60.0) -> Iterator[None]:
    """Fails a call that does not return (a stream whose worker died, a lock never freed)."""

    def expire(*_: object) -> None:
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def attempt(call: Callable[[], Any]) -> Any:
    """``call()``'s value, or None after checking that what it raised is a clear error."""
    with deadline():
        try:
            value = call()
        except Hang:
            raise
        except Exception as error:  # the property inspects every error
            assert_clear(error)
            event(f"refused: {type(error).__name__}")
            return None
    event("answered")
    return value


def stops_of(options: dict[str, Any]) -> list[str]:
    stop = options.get("stop")
    return [stop] if isinstance(stop, str) else list(stop or [])


def check_result(result: GenerationResult, options: dict[str, Any], window: int) -> None:
    assert isinstance(result, GenerationResult) and isinstance(result.text, str)
    assert result.finish_reason in FINISH
    new = len(result.token_ids)
    most = min(int(options.get("max_new_tokens", 256)), window - result.prompt_tokens)
    assert 1 <= new <= most and (new == most or result.finish_reason != "length")
    assert result.reused_tokens + result.recomputed_tokens == result.prompt_tokens
    assert 0 <= result.reused_tokens <= result.prompt_tokens < window
    assert result.passages_hit >= 0 and result.passages_missed >= 0
    assert not any(stop in result.text for stop in stops_of(options))


# -- strategies ---------------------------------------------------------------------------

# Characters the test tokenizer has tokens for (printable ASCII, space, newline): stop
# strings outside it are test_stop_string_the_tokenizer_cannot_spell's subject.
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"
WORDS = st.text(ALPHABET, min_size=1, max_size=12)
ANY_TEXT = st.text(max_size=12)  # any unicode but lone surrogates: emoji, RTL, NUL, ...
ODD_TEXT = st.sampled_from(["", "a\ud800b", "\udfff"])  # empty; lone surrogates
JUNK = st.sampled_from([None, 5, -1, 2.5, b"x", ["x"], {"a": 1}, object()])

NAN, INF = float("nan"), float("inf")
# Per sampling option: values a call may pass (edge values included: huge, tiny, numpy
# scalars) and values it may not. None is refused by the engine; the adapters read it as
# "keep the field", so it is only among the engine's refused values.
OPTIONS = {
    "max_new_tokens": (
        st.integers(1, MAX_NEW) | st.just(np.int64(2)),
        st.sampled_from([0, -1, True, False, 2.0, "2", NAN]),
    ),
    "temperature": (
        st.floats(0.0, 2.0) | st.sampled_from([1, 1e-6, 1e-30, 1e-300, 1e30, np.float32(0.5)]),
        st.sampled_from([-0.5, NAN, INF, -INF, True, "0.7"]),
    ),
    "top_p": (
        st.floats(0.0, 1.0, exclude_min=True) | st.sampled_from([1, 1e-300]),
        st.sampled_from([0, 1.5, NAN, INF, True, "0.5"]),
    ),
    "top_k": (
        st.integers(0, 60) | st.just(10**30),
        st.sampled_from([-1, True, 2.0, "5"]),
    ),
    "seed": (
        st.none() | st.integers(0, 2**64 - 1) | st.just(np.int64(3)),
        st.sampled_from([-1, 2**64, 2**70, True, 1.5, "7"]),
    ),
    "stop": (
        st.none()
        | WORDS
        | st.lists(WORDS, max_size=3)
        | st.lists(st.sampled_from(list(ALPHABET)), max_size=4).map(tuple),
        st.sampled_from(["", [""], ["a", ""], [5], [None], "\ud800", ["a", "\udfff"], 5, b"x"])
        | st.just({"a": 1}),
    ),
    "frequency_penalty": (st.nothing(), st.floats()),  # not an option
}


def sampling(max_key: str, none_refused: bool) -> st.SearchStrategy[tuple[dict, bool]]:
    """``(options, refused)``: valid options (``max_key`` always set, so a valid call
    decodes at most MAX_NEW tokens), and a third of the time one value the call must
    refuse."""
    names = [k for k, (ok, _) in OPTIONS.items() if k != "max_new_tokens" and not ok.is_empty]
    valid = st.fixed_dictionaries(
        {max_key: OPTIONS["max_new_tokens"][0]}, optional={k: OPTIONS[k][0] for k in names}
    )
    keys = st.sampled_from(sorted(OPTIONS))
    bad = keys.flatmap(lambda k: st.tuples(st.just(k), OPTIONS[k][1]))
    if none_refused:  # seed=None and stop=None are valid
        none_refused_keys = ["max_new_tokens", "temperature", "top_p", "top_k"]
        bad = bad | st.tuples(st.sampled_from(none_refused_keys), st.none())

    def inject(options: dict, item: tuple[str, Any]) -> tuple[dict, bool]:
        key = max_key if item[0] == "max_new_tokens" else item[0]
        return {**options, key: item[1]}, True

    fine = valid.map(lambda o: (o, False))
    return fine | fine | st.builds(inject, valid, bad)  # two thirds valid


SAMPLING = sampling("max_new_tokens", none_refused=True)
TEXT_PROMPT = WORDS | st.just(passage("a marked passage. ") + "q?") | ANY_TEXT
PROMPT = TEXT_PROMPT | ODD_TEXT | JUNK
PASSAGES = (
    st.none()
    | st.lists(WORDS, min_size=1, max_size=3)
    | st.lists(WORDS | ANY_TEXT | ODD_TEXT | JUNK, max_size=3)
    | WORDS  # a lone string, not a list
)
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
CALL = st.one_of(
    st.fixed_dictionaries(
        {"name": st.one_of(st.just("lookup"), JUNK)},
        optional={
            "arguments": st.one_of(
                st.just({"q": "x"}), st.just('{"q": "x"}'), st.just("{bad"), st.just(""), JUNK
            ),
            "id": st.one_of(WORDS, JUNK),
        },
    ),
    st.builds(lambda c: {"function": c}, st.one_of(st.just({"name": "lookup"}), JUNK)),
    JUNK,
)
ROLE = st.one_of(
    st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", ""]), JUNK
)
CONTENT = st.one_of(
    WORDS,
    ANY_TEXT,
    st.just([{"type": "text", "text": "hi"}]),
    st.just(passage("a marked passage")),
    JUNK,
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLE},
    optional={
        "content": CONTENT,
        "tool_calls": st.one_of(st.lists(CALL, max_size=2), JUNK),
        "tool_call_id": st.one_of(WORDS, JUNK),
        "name": st.one_of(WORDS, JUNK),
    },
)
PLAIN_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": WORDS}
)
MESSAGES = st.one_of(
    st.lists(PLAIN_MESSAGE, min_size=1, max_size=3),
    st.lists(PLAIN_MESSAGE, min_size=1, max_size=3),
    st.lists(st.one_of(PLAIN_MESSAGE, MESSAGE), min_size=1, max_size=3),
    st.lists(st.one_of(MESSAGE, JUNK), max_size=4),
    WORDS,
    st.none(),
)
FORM = st.sampled_from(
    [{}, {}, {"tools": [TOOL]}, {"response_format": {"type": "json_object"}}]
) | (
    st.fixed_dictionaries(
        {},
        optional={
            "tools": st.sampled_from([None, [TOOL], [], "lookup"]) | JUNK,
            "tool_choice": st.sampled_from(["auto", "required", "none", "lookup", "other", 5]),
            "parallel_tool_calls": st.sampled_from([True, False, "yes", None]),
            "constrain": st.sampled_from([True, False, None, "no"]),
            "response_format": st.sampled_from(
                [None, {"type": "json_object"}, {"type": "bogus"}, "json"]
            ),
        },
    )
)


def fuzz_engine() -> KVBoost:
    """The engine every fuzzing module serves its calls from."""
    model = make_model("llama")
    # One token per character: the tools' fallback instructions alone are ~530 tokens.
    # Llama's default RoPE has no length limit; the engine reads its window from here.
    model.config.max_position_embeddings = 1024
    return KVBoost(model, make_tokenizer(), KVBoostConfig(block_tokens=8))


def consume(stream: Any) -> tuple[list[str], GenerationResult]:
    deltas = list(stream)
    assert all(isinstance(d, str) and d for d in deltas)
    return deltas, stream.result
