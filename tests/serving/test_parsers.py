"""The glm45 reasoning and glm47 tool-call parsers, alone and through `ChatOutput`.

Expected results are written out by hand (examples) or known by construction (the property
test builds a model output from its parts with the format of docs/design.md §3.8 and checks that the
parts come back, whatever the stream's chunking)."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from serving.api.chat_output import ChatOutput, ChatParsing
from serving.api.protocol import ChatCompletionRequest
from serving.parsers import Glm45ReasoningParser, Glm47ToolCallParser, ParsedToolCall
from serving.parsers.arg_types import coerce_argument, schema_types
from serving.parsers.tags import partial_tag_len

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": "object"},
                    "hourly": {"type": "boolean"},
                    "temps": {"type": "array"},
                    "ratio": {"type": "number"},
                    "note": {"type": ["string", "null"]},
                    "mode": {"enum": ["fast", "slow"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def call_text(name: str, args: dict) -> str:
    """A call in the GLM-4.7/5 format: string values verbatim, other values as JSON."""
    body = "".join(
        f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>"
        for k, v in args.items()
    )
    return f"<tool_call>{name}{body}</tool_call>"


def feed_reasoning(parser: Glm45ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    r, c = zip(*[parser.feed(x) for x in chunks], parser.finish())
    return "".join(r), "".join(c)


def feed_tools(parser: Glm47ToolCallParser, chunks: list[str]) -> list:
    events: list = []
    for e in [e for x in chunks for e in parser.feed(x)] + parser.finish():
        if isinstance(e, str) and events and isinstance(events[-1], str):
            events[-1] += e
        else:
            events.append(e)
    return events


def splits_of(text: str):
    """Every way of cutting `text` once, plus one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


# ------------------------------------------------------------------------------ partial tags


def test_partial_tag_len():
    assert partial_tag_len("abc</th", ["</think>"]) == 4
    assert partial_tag_len("abc<", ["</think>", "<tool_call>"]) == 1
    assert partial_tag_len("abc</think>", ["</think>"]) == 0  # complete tags are not partial
    assert partial_tag_len("<tool_cal", ["</think>", "<tool_call>"]) == 9
    assert partial_tag_len("abc", ["</think>"]) == 0
    assert partial_tag_len("", ["</think>"]) == 0


# --------------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    "opens, text, expected",
    [
        (True, "Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
        (True, "Still thinking when cut", ("Still thinking when cut", "")),  # missing end tag
        (True, "cut inside the end tag </thi", ("cut inside the end tag </thi", "")),
        (True, "</think>Straight to it.", ("", "Straight to it.")),
        (True, "<think>again</think>x", ("again", "x")),  # a repeated opening tag is markup
        (True, "a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),  # only the first ends it
        (False, "Plain answer with </think> inside", ("", "Plain answer with </think> inside")),
        (False, "  <think>model-opened</think>rest", ("model-opened", "rest")),
        (False, "<thinking is not a tag", ("", "<thinking is not a tag")),
        (False, "  ", ("", "  ")),
        (True, "", ("", "")),
    ],
)
def test_reasoning_parser_examples_at_every_split(opens, text, expected):
    for chunks in splits_of(text):
        assert feed_reasoning(Glm45ReasoningParser(opens), chunks) == expected, chunks
    assert Glm45ReasoningParser(opens).parse(text) == expected


def test_reasoning_parser_holds_only_partial_tags():
    p = Glm45ReasoningParser(True)
    assert p.feed("abc </th") == ("abc ", "")
    assert p.feed("ink") == ("", "")
    assert p.feed("> done") == ("", " done")
    assert p.reasoning_ended
    p = Glm45ReasoningParser(True)
    assert p.feed("x </tx") == ("x </tx", "")  # not a prefix of </think>: released at once


# ---------------------------------------------------------------------------- tool arguments


@pytest.mark.parametrize(
    "raw, schema, expected",
    [
        ("007", {"type": "string"}, "007"),
        ("true", {"type": "string"}, "true"),
        ('  {"a": 1} ', {"type": "string"}, '  {"a": 1} '),
        ("42", {"type": "integer"}, 42),
        ("forty-two", {"type": "integer"}, "forty-two"),  # unparseable: raw string
        ("2.5", {"type": "number"}, 2.5),
        ("3", {"type": "number"}, 3),
        ("true", {"type": "boolean"}, True),
        ("False", {"type": "boolean"}, False),  # Python spelling accepted for booleans
        ('{"temp": "C"}', {"type": "object"}, {"temp": "C"}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("null", {"type": ["string", "null"]}, None),
        ("42", {"type": ["string", "null"]}, "42"),  # parsed type not allowed, string is
        ("fast", {"enum": ["fast", "slow"]}, "fast"),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
        ("7", None, 7),  # no schema: JSON, else string
        ("hello", None, "hello"),
        ("[" * 10000, {"type": "array"}, "[" * 10000),
    ],
)
def test_coerce_argument(raw, schema, expected):
    got = coerce_argument(raw, schema)
    assert got == expected and type(got) is type(expected)


def test_schema_types():
    assert schema_types({"type": "string"}) == {"string"}
    assert schema_types({"type": ["integer", "null"]}) == {"integer", "null"}
    assert schema_types({"oneOf": [{"type": "string"}, {"const": 3}]}) == {"string", "integer"}
    assert schema_types({"anyOf": [{"type": "string"}, {"$ref": "#/x"}]}) is None
    assert schema_types({"description": "no type"}) is None
    assert schema_types("not a schema") is None


# -------------------------------------------------------------------------------- tool calls


def test_several_calls_typed_by_schema_at_every_split():
    args1 = {"city": "Paris", "days": 3, "units": {"temp": "C"}, "hourly": True, "temps": [1.5, 2],
             "ratio": 0.25, "note": "null-ish", "mode": "slow"}
    args2 = {"city": "007", "days": "soon"}
    text = "Checking both.\n" + call_text("get_weather", args1) + "\n" + call_text("get_weather", args2) + \
        call_text("noop", {})
    expected = [
        "Checking both.\n",
        ParsedToolCall("get_weather", args1),
        "\n",
        ParsedToolCall("get_weather", {"city": "007", "days": "soon"}),
        ParsedToolCall("noop", {}),
    ]
    for chunks in splits_of(text):
        assert feed_tools(Glm47ToolCallParser(TOOLS), chunks) == expected, chunks
    got = Glm47ToolCallParser(TOOLS).parse(text)
    assert got == expected
    assert json.loads(got[1].arguments_json) == args1
    assert got[4].arguments_json == "{}"


def test_glm45_whitespace_and_unknown_tool():
    text = "<tool_call>get_weather\n<arg_key> city </arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>" \
        "<tool_call>lookup<arg_key>id</arg_key><arg_value>12</arg_value></tool_call>"
    assert Glm47ToolCallParser(TOOLS).parse(text) == [
        ParsedToolCall("get_weather", {"city": "Oslo"}),
        ParsedToolCall("lookup", {"id": 12}),  # undeclared tool: untyped JSON
    ]


@pytest.mark.parametrize(
    "text",
    [
        "Sure<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",  # cut mid-call
        "<tool_call></tool_call>",  # no name
        "<tool_call>get weather</tool_call>",  # a name with a space
        "<tool_call>get_weather<arg_key>city</arg_key></tool_call>",  # key without value
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value>junk</tool_call>",
        "<tool_call>get_weather<arg_key></arg_key><arg_value>x</arg_value></tool_call>",  # empty key
        "<tool_call>f<arg_key>a<arg_value>1</arg_value></arg_key><arg_value>2</arg_value></tool_call>",
        "<tool_call>f<arg_key>a</arg_key><arg_value>1<arg_key>b</arg_key><arg_value>2</arg_value></tool_call>",
        "stray </tool_call> and <arg_key>k</arg_key> in text",
        "<tool_call",  # a partial tag at the very end
    ],
)
def test_malformed_calls_are_content(text):
    for chunks in splits_of(text):
        assert feed_tools(Glm47ToolCallParser(TOOLS), chunks) == [text], chunks


def test_abandoned_call_then_good_call():
    text = "<tool_call>get_wea<tool_call>noop</tool_call>after"
    expected = ["<tool_call>get_wea", ParsedToolCall("noop", {}), "after"]
    for chunks in splits_of(text):
        assert feed_tools(Glm47ToolCallParser(TOOLS), chunks) == expected, chunks


def test_tool_parser_holds_back_only_what_it_must():
    p = Glm47ToolCallParser(TOOLS)
    assert p.feed("Hello <tool") == ["Hello "]
    assert p.feed("_call>noop") == []  # inside an open call: held
    assert p.feed("</tool_call> bye") == [ParsedToolCall("noop", {}), " bye"]
    assert p.finish() == []


# ------------------------------------------------------------- ChatOutput: stream == message


def _parsing_output(prompt_end: str = "<|assistant|><think>", tools=TOOLS) -> ChatOutput:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools)
    prepared = ChatParsing("glm45", "glm47", True).prepare(body)
    return prepared.new_output("[gMASK]<sop><|user|>x" + prompt_end)


def collect_stream(output: ChatOutput, chunks: list[str], finish: str = "stop") -> dict:
    reasoning, content, calls, finishes = [], [], {}, []
    pieces = [output.deltas(x) for x in chunks[:-1]] + [output.deltas(chunks[-1] if chunks else "", finish)]
    for delta, f in (p for piece in pieces for p in piece):
        finishes.append(f)
        d = delta.model_dump()
        assert d or f is not None, "an empty delta is only sent with the finish reason"
        reasoning.append(d.get("reasoning_content", ""))
        content.append(d.get("content", ""))
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert slot["id"] is None and tc["type"] == "function"
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
            slot["arguments"] += tc["function"]["arguments"]
    assert all(f is None for f in finishes[:-1])
    assert sorted(calls) == list(range(len(calls)))
    return {
        "reasoning": "".join(reasoning),
        "content": "".join(content),
        "calls": [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)],
        "finish": finishes[-1],
    }


def as_expected(message, finish) -> dict:
    return {
        "reasoning": message.reasoning_content or "",
        "content": message.content or "",
        "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls],
        "finish": finish,
    }


def test_chat_output_message_example():
    text = "\n  Weather needs a tool.\n</think>\n\nLet me check." + call_text("get_weather", {"city": "Rome", "days": 2}) \
        + "\n" + call_text("noop", {}) + "\n"
    message, finish = _parsing_output().message(text, "stop")
    assert message.reasoning_content == "Weather needs a tool."
    assert message.content == "Let me check."
    assert [c["function"]["name"] for c in message.tool_calls] == ["get_weather", "noop"]
    assert json.loads(message.tool_calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 2}
    assert message.tool_calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message.tool_calls)
    assert len({c["id"] for c in message.tool_calls}) == 2
    assert finish == "tool_calls"
    for chunks in splits_of(text):
        assert collect_stream(_parsing_output(), chunks) == as_expected(message, finish)


@pytest.mark.parametrize(
    "prompt_end, text, finish, expected",
    [
        # reasoning only, cut by max_tokens: no content, finish stays "length"
        ("<think>", "thinking on and on", "length", (None, "thinking on and on", [], "length")),
        # thinking disabled by the template: everything is content
        ("<think></think>", " Hi there ", "stop", ("Hi there", None, [], "stop")),
        # a call cut by max_tokens is returned as text and finish stays "length"
        ("<think>", "r</think><tool_call>noop", "length", ("<tool_call>noop", "r", [], "length")),
        # complete calls but cut afterwards: calls returned, finish "length"
        ("<think>", "r</think><tool_call>noop</tool_call>more", "length", ("more", "r", ["noop"], "length")),
        # a call inside the reasoning is reasoning text
        ("<think>", "<tool_call>noop</tool_call></think>ok", "stop", ("ok", "<tool_call>noop</tool_call>", [], "stop")),
        # an empty answer with no reasoning or calls is "" (not null)
        ("<think>", "</think>", "stop", ("", None, [], "stop")),
    ],
)
def test_chat_output_cases(prompt_end, text, finish, expected):
    message, reason = _parsing_output("<|assistant|>" + prompt_end).message(text, finish)
    names = [c["function"]["name"] for c in message.tool_calls]
    assert (message.content, message.reasoning_content, names, reason) == expected
    for chunks in splits_of(text):
        got = collect_stream(_parsing_output("<|assistant|>" + prompt_end), chunks, finish)
        assert got == as_expected(message, reason)


def test_raw_output_without_parsers_is_untouched():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    out = ChatParsing().prepare(body).new_output("<|assistant|><think>")
    message, finish = out.message("  r</think><tool_call>noop</tool_call> ", "stop")
    assert message.content == "  r</think><tool_call>noop</tool_call> " and message.reasoning_content is None
    assert message.tool_calls == [] and finish == "stop"
    # tools in the request but tool_choice "none": no tool parsing, reasoning still split
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")
    prepared = ChatParsing("glm45", "glm47", True).prepare(body)
    assert prepared.tools is None
    message, finish = prepared.new_output("<|assistant|><think>").message("r</think><tool_call>noop</tool_call>", "stop")
    assert (message.content, message.reasoning_content, finish) == ("<tool_call>noop</tool_call>", "r", "stop")


# --------------------------------------------------------------------- property: any chunking

_FRAGMENTS = ["a", "b", "Z", " ", "\n", "<", ">", "/", "_", "<think", "</think", "<tool_call", "</tool_call",
              "<arg_key", "arg_value>", "</", "你", "🙂", "think>", "tool_call>"]


def _free_text(min_size=0, max_size=8):
    return st.lists(st.sampled_from(_FRAGMENTS), min_size=min_size, max_size=max_size).map("".join).filter(
        lambda s: not any(t in s for t in TAGS)
    )


_ARGS = st.fixed_dictionaries(
    {},
    optional={
        "city": _free_text(),
        "days": st.integers(-5, 10**6),
        "units": st.dictionaries(st.sampled_from(["t", "u"]), st.integers(0, 3), max_size=2),
        "hourly": st.booleans(),
        "temps": st.lists(st.integers(0, 9), max_size=3),
    },
)
_CALL = st.one_of(st.tuples(st.just("get_weather"), _ARGS), st.just(("noop", {})))


@st.composite
def model_outputs(draw):
    opens = draw(st.booleans())
    reasoning = draw(_free_text()) if opens else ""
    closed = draw(st.booleans()) if opens else True
    parts = draw(st.lists(st.one_of(_free_text(1), _CALL), max_size=5)) if closed else []
    text = reasoning + ("</think>" if opens and closed else "")
    content, calls, run = [], [], ""
    for p in parts + [None]:
        if isinstance(p, str):
            run += p
            continue
        assume(not any(t in run for t in TAGS))  # adjacent free texts must not form a tag
        text += run
        content.append(run)
        run = ""
        if p is not None:
            text += call_text(*p)
            calls.append(p)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    return opens, text, chunks, reasoning.strip(), "".join(content).strip(), calls


@settings(max_examples=300, deadline=None)
@given(model_outputs())
def test_any_chunking_recovers_the_parts(case):
    opens, text, chunks, reasoning, content, calls = case
    prompt_end = "<|assistant|><think>" if opens else "<|assistant|><think></think>"
    expected = {"reasoning": reasoning, "content": content, "calls": [list(c) for c in calls],
                "finish": "tool_calls" if calls else "stop"}
    for split in (chunks, list(text)):  # the drawn cuts, and one character at a time
        got = collect_stream(_parsing_output(prompt_end), split)
        got["calls"] = [list(c) for c in got["calls"]]
        assert got == expected
    message, finish = _parsing_output(prompt_end).message(text, "stop")
    whole = as_expected(message, finish)
    whole["calls"] = [list(c) for c in whole["calls"]]
    assert whole == expected


def test_numbers_too_large_for_a_float_stay_valid_json():
    """`95E7336` is a JSON number (and a valid `number` argument) that Python reads as inf: the
    arguments JSON carries it as written, never `Infinity`; NaN / Infinity text is not JSON and
    stays a string."""
    import json

    from serving.parsers.tool_calls import Glm47ToolCallParser

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "array"}}}}}]
    (call,) = Glm47ToolCallParser(tools).parse(
        "<tool_call>add<arg_key>x</arg_key><arg_value>95E7336</arg_value><arg_key>y</arg_key><arg_value>-1e999"
        "</arg_value><arg_key>z</arg_key><arg_value>[1, 2.5, NaN]</arg_value></tool_call>")
    text = call.arguments_json
    assert "Infinity" not in text and "NaN" not in text.replace('"[1, 2.5, NaN]"', "")
    assert json.loads(text, parse_float=str) == {"x": "95E7336", "y": "-1e999", "z": "[1, 2.5, NaN]"}
