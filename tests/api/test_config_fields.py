"""``KVBoostConfig`` refuses, at construction and naming the field, every value its
annotation does not allow (issue 48 row 1: "no" for a bool was truthy, 1.5 bytes, a path
of 123 and a secret of 5 were taken and failed later, or turned a tier off)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pytest
from conftest import run_thorough
from hypothesis import assume, given
from hypothesis import strategies as st

from kvboost_rag import KVBoostConfig

FIELDS = [f.name for f in dataclasses.fields(KVBoostConfig)]

# The values, each refused with the field's name in the message.
REPORTED = [
    ("constrained_decoding", "no"),
    ("cache_generated", "yes"),
    ("passage_anchor", 3),
    ("max_cache_bytes", 1.5),
    ("remote_url", "redis://nohost:99999"),
    ("cache_dir", 123),
    ("cache_secret", 5),
]


@pytest.mark.parametrize("name, value", REPORTED)
def test_the_reported_values_are_refused_naming_the_field(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name}\b") as caught:
        KVBoostConfig(**{name: value})
    assert not isinstance(caught.value, TypeError)  # one kind of refusal for a config


def test_a_secret_is_not_echoed_in_its_refusal() -> None:
    with pytest.raises(ValueError, match="cache_secret") as caught:
        KVBoostConfig(cache_secret=123456789)
    assert "123456789" not in str(caught.value)


# What each field's annotation allows, written out by hand (not read from the annotations:
# the test is an oracle of its own). A field added to the config must be added here.
INT, REAL = "int", "real"
KINDS: dict[str, set[str]] = {
    "fidelity": {"str"},
    "max_cache_bytes": {INT},
    "block_tokens": {INT},
    "cache_generated": {"bool"},
    "repair": {"str", "none"},
    "recompute_ratio": {REAL, INT, "none"},
    "recompute_mass": {REAL, INT, "none"},
    "edge_tokens": {INT, "none"},
    "probe_layers": {INT, "none"},
    "max_passage_tokens": {INT},
    "passage_prefix": {"str"},
    "prefix_fallback": {"str"},
    "passage_anchor": {"bool"},
    "encode_batch_tokens": {INT},
    "cache_dir": {"str", "path", "none"},
    "max_disk_bytes": {INT},
    "remote_url": {"str", "none"},
    "remote_namespace": {"str"},
    "remote_timeout": {REAL, INT},
    "kv_codec": {"str"},
    "cache_secret": {"str", "bytes", "none"},
    "tool_format": {"str"},
    "constrained_decoding": {"bool"},
    "tool_result_notes": {"bool"},
    "max_batch_size": {INT, "none"},
    "kv_budget_bytes": {INT, "none"},
    "draft_tokens": {INT, "none"},
    "packed_head": {"bool", "none"},
    "packed_linears": {"bool"},
    "compiled_step": {"str"},
    "remember_measurements": {"bool"},
}


def kind(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return INT
    if isinstance(value, (float, np.floating)):
        return REAL
    if isinstance(value, PurePosixPath):
        return "path"
    return type(value).__name__


def test_the_table_covers_every_field() -> None:
    assert set(KINDS) == set(FIELDS)


ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.builds(Path, st.sampled_from(["/tmp/x", "cache"])),
    st.builds(np.int64, st.integers(-5, 5)),
    st.builds(np.float32, st.floats(-2, 2, width=32)),
    st.just(object()),
)


@pytest.mark.parametrize("name", FIELDS)
@given(value=ANY_VALUE)
def test_a_value_of_a_type_the_field_does_not_take_is_refused(name: str, value: Any) -> None:
    assume(kind(value) not in KINDS[name])  # right type: its range is the next property's
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        KVBoostConfig(**{name: value})


# Values of the right type but out of range, per field (the ranges the docs state).
BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "fidelity": st.text(max_size=6).filter(lambda s: s not in ("exact", "balanced", "fast")),
    "max_cache_bytes": st.integers(max_value=-1),
    "block_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=4097)),
    "repair": st.sampled_from(["", "blend", "EDGES", "full"]),
    "recompute_ratio": st.one_of(
        st.floats(max_value=-1e-9), st.floats(min_value=1.0 + 1e-9), st.just(math.nan)
    ),
    "edge_tokens": st.integers(max_value=-1),
    "probe_layers": st.integers(max_value=0),
    "max_passage_tokens": st.integers(max_value=0),
    "passage_prefix": st.sampled_from(["", "bos", "Prompt"]),
    "prefix_fallback": st.sampled_from(["", "near", "skip"]),
    "encode_batch_tokens": st.integers(max_value=0),
    "cache_dir": st.just(""),
    "max_disk_bytes": st.integers(max_value=-1),
    "remote_url": st.one_of(
        st.sampled_from(["http://h:6379", "localhost:6379", "redis-cluster://h", ""]),
        st.integers(65536, 10**6).map(lambda p: f"redis://host:{p}/0"),
        st.integers(65536, 10**6).map(lambda p: f"redis-cluster://a:7000,b:{p}"),
    ),
    "remote_namespace": st.sampled_from(["", "a b", "\tx"]),
    "remote_timeout": st.one_of(
        st.floats(max_value=0.0), st.just(math.nan), st.just(math.inf), st.integers(max_value=0)
    ),
    "kv_codec": st.sampled_from(["", "int4", "fp16", "INT8"]),
    "tool_format": st.sampled_from(["", "openai", "Auto"]),
    "max_batch_size": st.integers(max_value=0),
    "kv_budget_bytes": st.integers(max_value=0),
    "draft_tokens": st.one_of(st.integers(max_value=-1), st.integers(min_value=65)),
    "compiled_step": st.sampled_from(["", "yes", "True"]),
}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
@given(data=st.data())
def test_a_value_out_of_the_fields_range_is_refused(name: str, data: st.DataObject) -> None:
    value = data.draw(BAD_VALUES[name], label=name)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        KVBoostConfig(**{name: value})


def test_recompute_mass_out_of_range_is_refused() -> None:
    for value in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError, match="^recompute_mass"):
            KVBoostConfig(repair="query", recompute_mass=value)


GOOD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_cache_bytes": st.integers(0, 2**40) | st.builds(np.int64, st.integers(0, 2**40)),
    "block_tokens": st.integers(1, 4096),
    "recompute_ratio": st.floats(0, 1) | st.sampled_from([0, 1]),
    "cache_dir": st.sampled_from(["cache", Path("/tmp/kv"), None]),
    "remote_url": st.integers(1, 65535).map(lambda p: f"redis://h:{p}/0")
    | st.sampled_from(["unix:///tmp/r.sock", "rediss://:pw@h/1", "redis-cluster://a:1,b:2"]),
    "remote_timeout": st.floats(1e-3, 60) | st.integers(1, 60),
    "cache_secret": st.text(max_size=8) | st.binary(max_size=8) | st.none(),
    "draft_tokens": st.integers(0, 64) | st.none(),
    "constrained_decoding": st.booleans(),
    "tool_result_notes": st.booleans(),
    "packed_head": st.sampled_from([True, False, None]),
}


@pytest.mark.parametrize("name", sorted(GOOD_VALUES))
@given(data=st.data())
def test_a_value_the_field_takes_is_kept_as_given(name: str, data: st.DataObject) -> None:
    value = data.draw(GOOD_VALUES[name], label=name)
    assert getattr(KVBoostConfig(**{name: value}), name) == value


def test_refusals_say_what_the_field_takes() -> None:
    cases = {
        "constrained_decoding": ("no", "True or False"),
        "max_cache_bytes": (1.5, "an int"),
        "cache_dir": (123, "a str, a path or None"),
        "remote_timeout": ("1", "a finite number"),
    }
    for name, (value, wanted) in cases.items():
        with pytest.raises(ValueError) as caught:
            KVBoostConfig(**{name: value})
        assert wanted in str(caught.value), caught.value
        assert re.search(rf"got {re.escape(repr(value))}$", str(caught.value)), caught.value


@pytest.mark.slow
def test_every_property_holds_over_2000_examples() -> None:
    run_thorough(__file__, PASSED)


# The tests above as pytest counts them (run_thorough checks they all ran and passed).
PASSED = len(REPORTED) + 4 + len(FIELDS) + len(BAD_VALUES) + len(GOOD_VALUES)
