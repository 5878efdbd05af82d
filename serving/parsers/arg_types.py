"""Typing a tool-call argument from the tool's JSON schema.

GLM writes every argument value as text between `<arg_value>` tags: string values verbatim, other
values as JSON (the chat template's instruction, docs/design.md §3.8). To rebuild the call's JSON object:

* a parameter whose schema admits only strings keeps the raw text, unchanged (so `"007"` or
  `"true"` stay strings);
* otherwise the text is parsed as JSON; a value that does not parse stays the raw string (the
  client sees what the model wrote rather than an error). For a boolean parameter, Python-style
  `True`/`False` are accepted too;
* when the parsed value's JSON type is not allowed by the schema but a string is, the raw string
  is kept (for example a `["string", "null"]` parameter whose value reads `42`).

A parameter missing from the schema (or a tool the request did not declare) is parsed as JSON
with the same string fallback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

_JSON_TYPES = frozenset({"string", "integer", "number", "boolean", "object", "array", "null"})


def schema_types(schema: Any) -> frozenset[str] | None:
    """The JSON types a (sub)schema admits, or None when it does not say.

    Reads `type` (a name or a list of names), else `enum`/`const` (types of the listed values),
    else the union over `anyOf`/`oneOf` (None if any branch is unknown). `$ref` and other
    keywords are not followed (None).
    """
    if not isinstance(schema, Mapping):
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return frozenset({t}) & _JSON_TYPES or None
    if isinstance(t, list) and t:
        names = frozenset(x for x in t if isinstance(x, str)) & _JSON_TYPES
        return names or None
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return frozenset(_json_type(v) for v in schema["enum"])
    if "const" in schema:
        return frozenset({_json_type(schema["const"])})
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            out: set[str] = set()
            for b in branches:
                bt = schema_types(b)
                if bt is None:
                    return None
                out |= bt
            return frozenset(out)
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _admits(types: frozenset[str], value: Any) -> bool:
    t = _json_type(value)
    if t in types:
        return True
    # An integral float (1.0) is a valid JSON-schema integer; an integer is a valid number.
    if t == "integer" and "number" in types:
        return True
    return t == "number" and "integer" in types and float(value).is_integer()


class RawNumber(str):
    """A JSON number too large for a float (`1e999`: valid JSON, and valid for a `number`
    schema), kept as its text; `serving.parsers.tool_calls.ParsedToolCall.arguments_json` writes
    it back as that number, never as `Infinity` (which is not JSON)."""


def _parse_float(text: str) -> float | RawNumber:
    value = float(text)
    return value if math.isfinite(value) else RawNumber(text)


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN / Infinity; JSON does not


def coerce_argument(raw: str, schema: Any) -> Any:
    """The Python value of one argument's text `raw` under the parameter's JSON `schema`.

    `schema` is the parameter's sub-schema (`parameters.properties[key]`) or None. Never raises.
    """
    types = schema_types(schema)
    if types == frozenset({"string"}):
        return raw
    try:
        value = json.loads(raw, parse_float=_parse_float, parse_constant=_not_json)
    except (ValueError, RecursionError):  # (json.JSONDecodeError is a ValueError)
        if types is not None and "boolean" in types and raw.strip() in ("True", "False"):
            return raw.strip() == "True"
        return raw
    if types is None or _admits(types, value):
        return value
    return raw if "string" in types else value


def parameter_schemas(tools: Any) -> dict[str, dict[str, Any]]:
    """`{tool name: {parameter name: sub-schema}}` from OpenAI `tools` (malformed entries skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out
