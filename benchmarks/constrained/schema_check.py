"""A JSON Schema checker for the subset the benchmark's tasks use.

``jsonschema`` is not a dependency of the package, so this checks type, properties,
required, additionalProperties (false), items, minItems, maxItems, enum, const and anyOf,
and ``check_schema`` refuses any other keyword: a schema it cannot judge is an error,
never a silent pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Schema = Mapping[str, Any]
TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}
KEYWORDS = frozenset(
    "type properties required additionalProperties items minItems maxItems enum const anyOf "
    "description title".split()
)


def check_schema(schema: Any, where: str = "schema") -> None:
    """``ValueError`` unless ``schema`` uses only the keywords ``schema_errors`` checks."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where} is not a JSON schema object: {schema!r}")
    unknown = set(schema) - KEYWORDS
    if unknown:
        raise ValueError(f"{where} uses keywords this checker does not know: {sorted(unknown)}")
    if "type" in schema and schema["type"] not in TYPES:
        raise ValueError(f"{where} has an unknown type {schema['type']!r}")
    for key, sub in schema.get("properties", {}).items():
        check_schema(sub, f"{where}.{key}")
    for i, sub in enumerate(schema.get("anyOf", [])):
        check_schema(sub, f"{where}.anyOf[{i}]")
    if "items" in schema:
        check_schema(schema["items"], f"{where}[]")


def schema_errors(value: Any, schema: Schema, where: str = "$") -> list[str]:
    """Why ``value`` does not validate against ``schema`` (empty when it does)."""
    if "anyOf" in schema:
        if all(schema_errors(value, s, where) for s in schema["anyOf"]):
            return [f"{where}: matches none of anyOf"]
    if "const" in schema and value != schema["const"]:
        return [f"{where}: {value!r} != const {schema['const']!r}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} not in {schema['enum']}"]
    kind = schema.get("type")
    if kind is not None and not _is_type(value, kind):
        return [f"{where}: {value!r} is not of type {kind}"]
    if isinstance(value, dict):
        return _object_errors(value, schema, where)
    if isinstance(value, list):
        return _array_errors(value, schema, where)
    return []


def _is_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False  # JSON booleans are not numbers, though Python's bool is an int
    return isinstance(value, TYPES[kind])


def _object_errors(value: dict[str, Any], schema: Schema, where: str) -> list[str]:
    props = schema.get("properties", {})
    errors = [f"{where}: missing {k!r}" for k in schema.get("required", []) if k not in value]
    if schema.get("additionalProperties", True) is False:
        errors += [f"{where}: unexpected {k!r}" for k in value if k not in props]
    for key, item in value.items():
        if key in props:
            errors += schema_errors(item, props[key], f"{where}.{key}")
    return errors


def _array_errors(value: list[Any], schema: Schema, where: str) -> list[str]:
    errors = []
    if len(value) < schema.get("minItems", 0):
        errors.append(f"{where}: fewer than {schema['minItems']} items")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{where}: more than {schema['maxItems']} items")
    for i, item in enumerate(value):
        errors += schema_errors(item, schema.get("items", {}), f"{where}[{i}]")
    return errors
