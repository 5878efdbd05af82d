"""`StructuredOutputsParams`: what a request constrains its output to, and its grammar.

One of five kinds, as vLLM's `structured_outputs` spells them (and what the OpenAI fields map to):

* `json`: a JSON schema (a dict, or its JSON text) — `response_format` `json_schema`;
* `json_object`: any JSON object — `response_format` `{"type": "json_object"}`;
* `regex`: a regular expression the whole output matches (Rust `regex` syntax, as llguidance reads it);
* `choice`: the output is exactly one of the strings;
* `grammar`: a Lark grammar in llguidance's dialect (a GBNF grammar, recognised by its `::=`
  rules, is converted first) — also what `tool_choice` "required" / a named function compile to
  (`serving.structured_outputs.tool_grammar`).

`grammar_text()` turns the kind into one llguidance grammar (its JSON-schema, regex and Lark
front ends); the backend (`serving.structured_outputs.backend`) compiles it against the model's
tokenizer, which is where a bad schema, regex or grammar is found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """A constraint that cannot be compiled. `param` names the request field (e.g.
    `response_format`, `structured_outputs.regex`, `tool_choice`) for the 400's `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """A request's output constraint (exactly one kind set).

    json: a JSON schema (dict, or JSON text). json_object: any JSON object. regex: the output's
    regular expression. choice: the allowed outputs. grammar: a Lark (llguidance) or GBNF grammar.
    disable_any_whitespace: JSON without free whitespace between tokens (compact separators)
        instead of any whitespace the model chooses (vLLM's option of the same name).
    disable_additional_properties: objects of a JSON schema that do not say
        `additionalProperties` get `false` (vLLM's option), so the model cannot add keys.
    reasoning_end_token_id: with a reasoning parser and a prompt that opens the reasoning block,
        the id of the token that ends it (`</think>`): the constraint applies only after it, as
        vLLM does. None: from the first generated token.
    param: the request field it came from (named in errors).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_end_token_id: int | None = None
    param: str = "structured_outputs"

    def kind(self) -> str:
        """The one kind set. Raises StructuredOutputsError when none or several are."""
        set_ = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_) != 1:
            raise StructuredOutputsError(
                f"exactly one of {', '.join(KINDS)} must be set, got {', '.join(set_) or 'none'}", self.param)
        return set_[0]

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint.

        Raises StructuredOutputsError for a value of the wrong type (a schema that is not a JSON
        object, an empty choice list, ...). Schema, regex and grammar *contents* are checked when
        the backend compiles them."""
        import llguidance

        kind = self.kind()
        where = self.where
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise StructuredOutputsError(f"the JSON schema is not valid JSON: {e}", where) from None
            if not isinstance(schema, dict):
                raise StructuredOutputsError("the JSON schema must be a JSON object", where)
            if self.disable_additional_properties:
                schema = _close_objects(schema)
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except (ValueError, TypeError) as e:
                raise StructuredOutputsError(f"invalid JSON schema: {e}", where) from None
        if kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise StructuredOutputsError("the regex must be a non-empty string", where)
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            ch = self.choice
            if not isinstance(ch, list) or not ch or not all(isinstance(c, str) and c for c in ch):
                raise StructuredOutputsError("choice must be a non-empty list of non-empty strings", where)
            # One regex alternation (a Lark rule of literals is limited to 2,000 alternatives by
            # llguidance's parser; the regex lexer is not).
            return llguidance.LLMatcher.grammar_from_regex("|".join(regex_literal(c) for c in dict.fromkeys(ch)))
        g = self.grammar
        if not isinstance(g, str) or not g.strip():
            raise StructuredOutputsError("the grammar must be a non-empty string", where)
        if "::=" in g:  # GBNF (llama.cpp), as vLLM's guidance backend accepts it
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                g = gbnf_to_lark(g)
            except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad input
                raise StructuredOutputsError(f"invalid GBNF grammar: {e}", where) from None
        return llguidance.LLMatcher.grammar_from_lark(g)

    @property
    def where(self) -> str:
        """The request field to name in an error about this constraint's content."""
        try:
            kind = self.kind()
        except StructuredOutputsError:
            return self.param
        return f"{self.param}.{kind}" if self.param == "structured_outputs" else self.param


def json_schema_error(schema: dict) -> str:
    """What llguidance's compiler says of a JSON schema (an unknown type, a keyword of the wrong
    type, ...), "" when it compiles: the backend's check at admission, without a tokenizer (for
    schemas that are checked but not constrained on their own, e.g. a forced tool call's whole
    `parameters`). Raises StructuredOutputsError when llguidance refuses to convert it at all."""
    import llguidance

    grammar = StructuredOutputsParams(json=dict(schema)).grammar_text()
    return (llguidance.LLMatcher.validate_grammar(grammar) or "").strip()


def regex_literal(text: str) -> str:
    """`text` as a regex (Rust `regex` syntax) matching exactly it: ASCII letters, digits and `_`
    as they are, other ASCII characters as `\\x{HH}` escapes, other characters as they are."""
    return "".join(c if (c.isascii() and (c.isalnum() or c == "_")) or not c.isascii() else f"\\x{{{ord(c):02x}}}"
                   for c in text)


def _close_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema without `additionalProperties` gets
    `additionalProperties: false` (recursively through properties, items, combinators and $defs)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {k: _close_objects(v) for k, v in schema[key].items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMA_KEYS = frozenset({"items", "anyOf", "oneOf", "allOf", "not", "prefixItems", "additionalItems",
                             "if", "then", "else", "contains"})
