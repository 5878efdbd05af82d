"""A request's output constraint from its OpenAI / vLLM fields (docs/structured_outputs.md).

* `response_format` (both endpoints, as vLLM): `{"type": "json_object"}`, or `{"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}` (`"text"` is no
  constraint; a missing `type` is a 400);
* vLLM's `structured_outputs` (both endpoints): exactly one of `json`, `regex`, `choice`,
  `grammar`, `json_object`, with the options `disable_any_whitespace` and
  `disable_additional_properties`; any other key (`structural_tag`, `whitespace_pattern`, ...)
  is a 400, never a silently unconstrained answer. Next to `response_format`, a
  `structured_outputs` with options only applies them to the format's constraint (as vLLM merges
  the two);
* chat `tool_choice` "required" or a named function: the glm47 tool-call grammar
  (`serving.api.chat_output.PreparedChat.tool_grammar`).

At most one of them per request (400 naming the second). vLLM's removed `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` fields are refused with a pointer to
`structured_outputs`. Which fields are set is checked here; their values (types, and whether a
schema, regex or grammar compiles) by the engine when the request is added
(`StructuredOutputsError`, also a 400 naming the field).
"""

from __future__ import annotations

from typing import Any

from serving.api.errors import bad_request
from serving.structured_outputs import StructuredOutputsParams

REFUSED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
           "guided_whitespace_pattern", "guided_json_object")
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")


def _options(so: Any) -> tuple[list[str], dict[str, bool]]:
    """Check a `structured_outputs` object's keys → (the constraint kinds it sets, its options)."""
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object.", "structured_outputs")
    unknown = sorted(set(so) - set(_KINDS) - set(_OPTIONS) - {"backend"})
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported by this server (supported: "
                          f"{', '.join(_KINDS + _OPTIONS)}).", f"structured_outputs.{unknown[0]}")
    backend = so.get("backend")
    if backend not in (None, "auto", "guidance"):
        raise bad_request(f"structured_outputs.backend {backend!r} is not available; this server uses llguidance "
                          '("guidance").', "structured_outputs.backend")
    for opt in _OPTIONS:
        if not isinstance(so.get(opt, False), bool):
            raise bad_request(f"structured_outputs.{opt} must be a boolean.", f"structured_outputs.{opt}")
    return [k for k in _KINDS if so.get(k) not in (None, False)], {o: bool(so.get(o, False)) for o in _OPTIONS}


def _from_structured_outputs(so: dict, kinds: list[str], options: dict[str, bool]) -> StructuredOutputsParams:
    """The constraint of a `structured_outputs` object whose keys `_options` checked."""
    if len(kinds) != 1:
        raise bad_request(f"structured_outputs needs exactly one of {', '.join(_KINDS)}"
                          f"{'' if not kinds else ', got ' + ', '.join(kinds)} (its options alone constrain "
                          "nothing; next to response_format they apply to it).", "structured_outputs")
    kind = kinds[0]
    if kind == "json_object" and so[kind] is not True:
        raise bad_request("structured_outputs.json_object must be true.", "structured_outputs.json_object")
    # The value's type and content are checked where it compiles (StructuredOutputsParams.grammar_text
    # and the engine's backend), which name the same field.
    return StructuredOutputsParams(**{kind: so[kind]}, **options)


def _from_response_format(fmt: dict) -> StructuredOutputsParams | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad_request('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.',
                          "response_format")
    # An absent schema allows any JSON value (OpenAI requires one; vLLM accepts its absence).
    return StructuredOutputsParams(json=spec.get("schema", {}), param="response_format")


def request_constraint(body: Any, tool_grammar: str | None = None,
                       reasoning_end_token_id: int | None = None) -> StructuredOutputsParams | None:
    """The `StructuredOutputsParams` of a chat or completion request body, or None.

    tool_grammar: the Lark grammar a forced `tool_choice` compiled to (chat), or None.
    reasoning_end_token_id: the `</think>` id when a reasoning parser runs and the prompt opens the
    reasoning block (the constraint then starts after it), else None.
    Raises APIError (400) naming the field."""
    extra = body.model_extra or {}
    for name in REFUSED_FIELDS:
        if name in extra:
            raise bad_request(f"{name} is not supported; use structured_outputs (vLLM's current field) or "
                              "response_format.", name)
    found: list[StructuredOutputsParams] = []
    if tool_grammar is not None:
        # (Its compile errors come from the tools' parameter schemas.)
        found.append(StructuredOutputsParams(grammar=tool_grammar, param="tools"))
    fmt = getattr(body, "response_format", None)
    from_format = _from_response_format(fmt) if fmt else None
    if from_format is not None:
        found.append(from_format)
    so = body.structured_outputs
    if so is not None:
        kinds, options = _options(so)
        if not kinds and from_format is not None:
            # vLLM's merge: options without a constraint of their own apply to response_format's.
            for o, v in options.items():
                setattr(from_format, o, v)
        else:
            found.append(_from_structured_outputs(so, kinds, options))
    if len(found) > 1:
        raise bad_request(f"{found[1].param} cannot be combined with {found[0].param}: a request has one output "
                          "constraint.", found[1].param)
    if not found:
        return None
    if body.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with an output constraint (the grammar ends the output).",
                          "ignore_eos")
    found[0].reasoning_end_token_id = reasoning_end_token_id
    return found[0]


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when the tokenizer has it as one token, else None."""
    ids = tokenizer.encode(text)
    return int(ids[0]) if len(ids) == 1 else None
