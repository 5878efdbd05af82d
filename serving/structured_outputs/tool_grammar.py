"""The glm47 tool-call grammar: what `tool_choice` "required" or a named function constrains the
output to.

The output is one or more calls in the format the chat template teaches the model and
`serving.parsers.tool_calls.Glm47ToolCallParser` reads (docs/design.md §3.8):

    <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value>...</tool_call>

and nothing else (the end-of-turn token follows). NAME is one of the request's tools (the named
one for a named `tool_choice`); the keys are that tool's parameters in the schema's order, the
required ones always, the others optionally; each value is what the parser turns back into the
argument (`serving.parsers.arg_types.coerce_argument`):

* a parameter whose schema admits only strings is raw text: one of its `enum` values (a value
  with `<` is refused: raw text ends at the closing tag's `<`), a text matching its `pattern`
  (used as given: a pattern that can match `</arg_value>` can end the value early), or any text
  without `<` within its `minLength` / `maxLength`;
* any other parameter is JSON valid against its schema (llguidance's `%json` inside the Lark
  grammar), which the parser loads back.

So every call the grammar admits parses into arguments that validate against the tool's
`parameters` schema (for the keywords llguidance's JSON-schema compiler implements).
"""

from __future__ import annotations

import json
import re
from typing import Any

from serving.parsers.arg_types import schema_types


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _string_value(schema: dict) -> str:
    """The Lark expression of a string-only parameter's raw value."""
    enum = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        if any("<" in v for v in enum):
            raise ValueError(f"the string value {next(v for v in enum if '<' in v)!r} cannot be written in a glm47 "
                             "tool call (a raw value ends at the first '<' of its closing tag)")
        return "(" + " | ".join(_literal(v) for v in dict.fromkeys(enum)) + ")"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        # JSON-schema patterns are unanchored searches; the value must still avoid the tags.
        body = pattern.removeprefix("^").removesuffix("$")
        return "/" + body.replace("/", "\\/") + "/"
    lo = int(schema.get("minLength", 0) or 0)
    hi = schema.get("maxLength")
    rep = f"{{{lo},{int(hi)}}}" if isinstance(hi, int) else (f"{{{lo},}}" if lo else "*")
    return f"/[^<]{rep}/"


def _value(schema: Any, defs: dict) -> str:
    """defs: the `parameters` schema's `$defs` / `definitions`, copied into each parameter's
    schema so that its `$ref`s (`#/$defs/...`, as pydantic writes them) resolve there."""
    schema = schema if isinstance(schema, dict) else {}
    if schema_types(schema) == frozenset({"string"}):
        return _string_value(schema)
    return "%json " + json.dumps({**defs, **schema} if schema else {}, ensure_ascii=False)


def tool_call_lark(tools: list[dict], name: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar of a turn made of tool calls.

    tools: the request's OpenAI `tools` (`{"type": "function", "function": {name, parameters}}`).
    name: the function a named `tool_choice` forces, or None for "required" (any of `tools`).
    parallel: several calls allowed (`parallel_tool_calls`, default true); else exactly one.

    Raises ValueError when `name` is not among the tools or no tool has a usable name."""
    fns = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            fns.append(fn)
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the request's tools")
    if not fns:
        raise ValueError("tool_choice needs at least one function in tools")
    rules = []
    calls = []
    for i, fn in enumerate(fns):
        if re.search(r"[\s<>]", fn["name"]):
            raise ValueError(f"function name {fn['name']!r} cannot be written in a glm47 tool call")
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or ())
        defs = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
        parts = []
        for j, (key, sub) in enumerate(props.items()):
            rules.append(f"arg_{i}_{j}: <arg_key> {_literal(key)} </arg_key> <arg_value> {_value(sub, defs)} </arg_value>")
            parts.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
        rules.append(f"call_{i}: <tool_call> {_literal(fn['name'])} {' '.join(parts)} </tool_call>")
        calls.append(f"call_{i}")
    rules.insert(0, "call: " + " | ".join(calls))
    rules.insert(0, "start: call" + ("+" if parallel else ""))
    return "\n".join(rules) + "\n"
