"""Structured outputs through the HTTP API, with the `openai` client against a live server over the
real tiny engine (random weights: only the mask makes its output parse).

`response_format` (`json_object`, `json_schema`) on chat, vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `grammar` in Lark and GBNF) on both endpoints, `tool_choice` "required" and a
named function (glm47 calls whose arguments validate against the tool's parameters), streaming and
not, several choices at temperature 1; and the 400s: a bad schema, regex or grammar, an unsupported
key, the removed `guided_*` fields, two constraints at once, `ignore_eos`, a forced tool choice
without tools — after which the engine still serves and holds no request.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import openai
import pytest

from glm53.tokenizer import GlmTokenizer
from serving.api import build_app
from serving.api.chat_output import ChatParsing
from serving.async_engine import AsyncEngine
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from tests.helpers.live_server import live_server
from tests.serving.test_structured_outputs import CHOICES, MAX_TOKENS, PERSON, POINT

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

MODEL = "tiny-structured"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"}},
    "required": ["city", "days"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOW]


@pytest.fixture(scope="module")
def served():
    # The tools' description makes a 432-token prompt: room for it and the calls.
    e = build_engine(EngineArgs(max_model_len=768, max_num_seqs=8, max_num_batched_tokens=64, cuda_graph_sizes=[],
                                precompile_token_paddings=[], enable_prefix_caching=True, compile_progress=False,
                                disable_log_stats=True, async_scheduling=True,
                                # A random-weight model pads free whitespace until max_tokens.
                                structured_outputs_config={"disable_any_whitespace": True}))
    ae = AsyncEngine(e, MODEL)
    tok = GlmTokenizer.from_pretrained(e.model_path)
    parsing = ChatParsing(reasoning_parser="glm45", tool_call_parser="glm47", enable_auto_tool_choice=True)
    with (live_server(build_app(ae, tok, MODEL, chat_parsing=parsing)) as url,
          openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client):
        yield client, e
    ae.shutdown()
    assert not e.structured.requests and e.pool.num_free == e.pool.num_usable_blocks


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Hello there!"}])
    kw.setdefault("max_tokens", MAX_TOKENS)
    extra = {**NO_THINK, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL, extra_body=extra, **kw)


def test_response_format_json_schema_validates_in_every_choice(served):
    client, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, response_format=fmt, n=4, temperature=1.0, seed=11)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
    stream = chat(client, response_format=fmt, temperature=1.0, seed=5, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_structured_outputs_options_apply_to_response_format(served):
    """As vLLM merges them: `structured_outputs` with options only, next to `response_format`,
    applies its options to the format's schema (here no properties beyond the schema's); options
    alone, without a constraint, are a 400 that says so."""
    client, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}
    r = chat(client, response_format=fmt, n=4, temperature=1.0, seed=21,
             extra_body={"structured_outputs": {"disable_additional_properties": True}})
    closed = {**POINT, "additionalProperties": False}
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), closed)
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert err.value.body["param"] == "structured_outputs" and "options alone" in err.value.body["message"]


def test_response_format_json_object_gives_objects(served):
    """Any JSON object: unbounded strings and numbers, so a random-weight model may run out of
    max_tokens inside one; every choice that ends by itself parses to an object."""
    client, _ = served
    r = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=3, n=8, max_tokens=200)
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert len(done) >= 2
    for c in done:
        assert isinstance(json.loads(c.message.content), dict)
    assert all(c.message.content.startswith("{") for c in r.choices)


@pytest.mark.parametrize("so, ok", [
    ({"regex": r"[a-z]{2,5}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
    ({"choice": CHOICES}, lambda t: t in CHOICES),
    ({"grammar": 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'}, lambda t: re.fullmatch(r"x=[0-9]{1,3};", t)),
    ({"grammar": 'root ::= "id-" [0-9] [0-9]'}, lambda t: re.fullmatch(r"id-[0-9][0-9]", t)),  # GBNF
    ({"json": PERSON, "disable_any_whitespace": True}, lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
])
def test_structured_outputs_on_completions_streaming_and_not(served, so, ok):
    client, _ = served
    r = client.completions.create(model=MODEL, prompt="Hello there!", max_tokens=MAX_TOKENS, temperature=1.0,
                                  seed=3, n=2, extra_body={"structured_outputs": so})
    for c in r.choices:
        assert c.finish_reason == "stop" and ok(c.text), c.text
    stream = client.completions.create(model=MODEL, prompt="Hello there!", max_tokens=MAX_TOKENS, temperature=1.0,
                                       seed=4, stream=True, extra_body={"structured_outputs": so})
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert ok(text), text


def test_response_format_on_completions(served):
    client, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.completions.create(model=MODEL, prompt="Hello there!", max_tokens=MAX_TOKENS, temperature=1.0,
                                  seed=7, extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def _check_calls(calls, names):
    assert calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_gives_calls_whose_arguments_validate(served):
    client, _ = served
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=2, n=3, max_tokens=160)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and not c.message.content
        _check_calls(c.message.tool_calls, {"get_weather", "now"})
    stream = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=9, stream=True, max_tokens=160)
    calls, finish = {}, None
    for ch in stream:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if tc.index not in calls:
                calls[tc.index] = tc
            elif tc.function.arguments:  # the arguments may come in several deltas
                calls[tc.index].function.arguments = (calls[tc.index].function.arguments or "") + tc.function.arguments
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    assert finish == "tool_calls"
    _check_calls(list(calls.values()), {"get_weather", "now"})


def test_a_named_tool_choice_calls_that_function_once(served):
    client, _ = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=1, n=3, max_tokens=160)
    for c in r.choices:
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, {"get_weather"})


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"json_schema": {"name": "x", "schema": PERSON}}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": r"[^\s\S]"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nothing_here"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "{}"}}}, "structured_outputs.structural_tag"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"extra_body": {"guided_json": PERSON}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos"),
])
def test_bad_constraints_are_400s_naming_the_field_and_the_server_serves_on(served, kw, param):
    client, engine = served
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, **kw)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    r = chat(client, extra_body={"structured_outputs": {"choice": CHOICES}}, temperature=1.0, seed=0)
    assert r.choices[0].message.content in CHOICES
    assert not engine.structured.requests


def test_a_slow_grammar_compile_does_not_stall_other_streams(served):
    """Constraints compile in a worker thread before the request reaches the engine
    (`AsyncEngine.generate` → `precompile_constraint`): while one takes 1.5 s, an unconstrained
    stream keeps receiving tokens (compiled on the engine thread, it would receive none)."""
    client, e = served
    backend = e.structured.backend
    real, window = backend.matcher, {}

    def slow(params):
        window["start"] = time.monotonic()
        time.sleep(1.5)
        window["end"] = time.monotonic()
        return real(params)

    stamps, finish, done = [], [], threading.Event()

    def stream():  # long enough to outlast the slow compile on any machine; closed once it is over
        with client.completions.create(model=MODEL, prompt="Hello there!", max_tokens=500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}) as chunks:
            for chunk in chunks:
                stamps.append(time.monotonic())
                finish.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
                if done.is_set():
                    break

    backend.matcher = slow
    try:
        t = threading.Thread(target=stream)
        t.start()
        while len(stamps) < 3 and t.is_alive():
            time.sleep(0.01)
        r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=MAX_TOKENS,
                                      extra_body={"structured_outputs": {"choice": CHOICES}})
        alive = t.is_alive()  # the stream still running after the constrained request finished
        done.set()
        t.join()
    finally:
        backend.matcher = real
    assert r.choices[0].text in CHOICES
    # The stream ran past the slow compile with no error (an error would end it early, with a
    # finish reason) and was closed by the client (the server aborts it).
    assert alive and finish == [], (alive, finish)
    during = [x for x in stamps if window["start"] + 0.2 < x < window["end"]]
    assert len(during) >= 5, (len(stamps), window)
