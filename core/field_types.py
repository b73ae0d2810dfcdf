"""A frozen dataclass's field values checked against their annotations, so a value of the
wrong type is refused where it is given, naming the field, instead of being taken ("no" is
truthy) or failing deep inside a tier later (issue 48)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


def check_field_types(instance: Any) -> None:
    """Raise ``ValueError`` for the first field of the dataclass ``instance`` whose value its
    annotation does not allow: "``name`` must be <what it takes>, got <value>" (a field
    declared ``repr=False``, a secret, is named by its value's type only)."""
    hints = _hints(type(instance))  # type: ignore[arg-type]  # a class is hashable
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if not matches(value, hints[field.name]):
            shown = repr(value) if field.repr else f"a value of type {type(value).__name__}"
            raise ValueError(f"{field.name} must be {describe(hints[field.name])}, got {shown}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type. Numbers are by kind, not class (numpy's
    too), never bool for a number, and floats finite; ``Path`` takes any path-like."""
    origin = get_origin(hint)
    if origin is Literal:
        return any(type(value) is type(arg) and value == arg for arg in get_args(hint))
    if origin in (Union, types.UnionType):
        return any(matches(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return _is_number(value) and math.isfinite(value)
    if isinstance(hint, type) and issubclass(hint, os.PathLike):
        return isinstance(value, os.PathLike)
    assert isinstance(hint, type), f"no check for the annotation {hint!r}"
    return isinstance(value, hint)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def describe(hint: Any) -> str:
    """What a value of the annotated type is, in words: "an int or None"."""
    origin = get_origin(hint)
    if origin is Literal:
        return f"one of {get_args(hint)}"
    if origin in (Union, types.UnionType):
        parts = [describe(arg) for arg in get_args(hint)]
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    words = {
        type(None): "None",
        bool: "True or False",
        int: "an int",
        float: "a finite number",
        bytes: "bytes",
    }
    if hint in words:
        return words[hint]
    if isinstance(hint, type) and issubclass(hint, os.PathLike):
        return "a path"
    return f"a {hint.__name__}"
