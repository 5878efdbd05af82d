"""Schema-driven fuzzing of the OpenAPI surface against a live server (the real engine, tiny
checkpoint): hypothesis builds request bodies over every field of the request models
(`ChatCompletionRequest`, `CompletionRequest`), each field either a plausible value (including
edge cases: out-of-range token ids, negative or huge limits, empty lists, junk roles) or junk of
any JSON type, plus unknown keys, non-object bodies and bytes that are not JSON.

Every answer must be a 2xx or a 4xx with an OpenAI error body whose `code` is the status; no
5xx, no dropped connection, no in-band error event in a stream. Afterwards the server is healthy,
no request is left in the engine and the block-pool audit is clean. The number of examples per
endpoint is `$GLM53_FUZZ_EXAMPLES` (default 150)."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.api.protocol import ChatCompletionRequest, CompletionRequest
from serving.api.responses import ResponsesRequest
from serving.run import build_server
from tests.helpers.live_server import live_server
from tests.serving.test_e2e_server import ARGV

EXAMPLES = int(os.environ.get("GLM53_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)
text = st.text(max_size=40) | st.sampled_from(["hello", "<|user|>", "\u0000", "\ud7ff\ue000", "a" * 200, ""])
token_ids = st.lists(st.integers(-3, 520) | st.integers(-2**40, 2**40), max_size=12)
small_limit = st.integers(-2, 12) | st.sampled_from([0, 10**6, 2**63])
prob = st.floats(-1, 3, allow_nan=False) | st.sampled_from([0.0, 1.0, 1e-9])
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "", "x" * 70])},
    optional={"parameters": st.just({"type": "object", "properties": {"city": {"type": "string"}}}) | junk})})
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "junk"])}, optional={"text": text})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]) | junk},
    optional={"content": text | st.lists(part, max_size=2) | st.none() | junk, "name": text,
              "tool_call_id": text, "tool_calls": junk, "reasoning_content": text})

COMMON = {
    "model": st.just("glm-5.3-tiny") | text | junk,
    "temperature": prob | junk, "top_p": prob | junk, "top_k": st.integers(-2, 600) | junk,
    "min_p": prob, "seed": st.integers(-2**64, 2**64) | junk, "n": st.integers(-1, 3) | junk,
    "stop": text | st.lists(text, max_size=5) | junk, "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | junk,
                                                          "continuous_usage_stats": st.booleans() | junk}) | junk,
    "min_tokens": st.integers(-1, 4) | junk, "prompt_logprobs": st.integers(-2, 25) | junk,
    "presence_penalty": prob | junk, "frequency_penalty": prob | junk, "repetition_penalty": prob | junk,
    "logit_bias": st.dictionaries(st.sampled_from(["5", "-1", "999", "x"]), st.floats(-200, 200)) | junk,
    "ignore_eos": st.booleans() | junk, "stop_token_ids": token_ids | junk, "skip_special_tokens": st.booleans(),
    "structured_outputs": st.sampled_from([{"choice": ["a", "b"]}, {"regex": "[a-z]{1,3}"}, {"json_object": True},
                                           {"json": {"type": "object"}}, {"regex": "[a-"}, {"grammar": "start: x"},
                                           {"choice": []}, {"structural_tag": "x"}]) | junk,
    "thinking_token_budget": st.integers(-2, 6) | junk,
}
CHAT = {**COMMON,
        "messages": st.lists(message, max_size=4) | junk,
        "max_completion_tokens": small_limit | junk, "reasoning_effort": st.sampled_from(["low", "high", "x"]) | junk,
        "tools": st.lists(tool, max_size=2) | junk,
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"]) | junk, "parallel_tool_calls": st.booleans(),
        "logprobs": st.booleans() | junk, "top_logprobs": st.integers(-1, 30) | junk,
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                                "type": "object", "properties": {"a": {"type": "boolean"}}}}}])
        | junk,
        "chat_template_kwargs": st.dictionaries(st.text(max_size=8), junk, max_size=2) | junk,
        "add_generation_prompt": st.booleans() | junk, "continue_final_message": st.booleans() | junk,
        "echo": st.booleans() | junk, "best_of": st.integers(-1, 3)}
COMPLETION = {**COMMON,
              "prompt": text | token_ids | st.lists(text, max_size=3) | st.lists(token_ids, max_size=3) | junk,
              "echo": st.booleans() | junk, "logprobs": st.integers(-1, 30) | junk, "best_of": st.integers(-1, 3),
              "suffix": text | junk, "return_token_ids": st.booleans() | junk,
              "max_completion_tokens": small_limit | junk,
              "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {}]) | junk}
assert set(CHAT) >= set(ChatCompletionRequest.model_fields) - {"max_tokens"}
assert set(COMPLETION) >= set(CompletionRequest.model_fields) - {"max_tokens"}


# Valid values only: the requests that must succeed (the wide strategies above are the edge cases).
ok_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30)
VALID_COMMON = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.sampled_from([-1, 1, 5, 50]),
    "seed": st.integers(0, 2**32), "n": st.integers(1, 2), "stop": ok_text | st.lists(ok_text, max_size=2),
    "stream": st.booleans(), "stream_options": st.just({"include_usage": True}), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 495), max_size=2), "skip_special_tokens": st.booleans(),
    "thinking_token_budget": st.integers(0, 4),
}
VALID_CHAT = {**VALID_COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "tools": st.lists(tool.filter(lambda t: t["type"] == "function" and t["function"]["name"] == "get_weather"
                                            and "parameters" not in t["function"]), max_size=1)}
VALID_COMPLETION = {**VALID_COMMON, "logprobs": st.integers(0, 5), "echo": st.booleans(),
                    "prompt_logprobs": st.integers(0, 3), "return_token_ids": st.booleans()}
REQUIRED = {
    "chat": {"model": st.just("glm-5.3-tiny"), "max_tokens": st.integers(1, 8), "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": ok_text}), min_size=1,
        max_size=3).filter(lambda ms: ms[-1]["role"] == "user")},
    "completion": {"model": st.just("glm-5.3-tiny"), "max_tokens": st.integers(1, 8),
                   "prompt": ok_text | st.lists(st.integers(0, 495), min_size=1, max_size=12)},
}


def encode_body(x) -> bytes:
    """A drawn body as the bytes sent (bytes as they are, a str as text, anything else as JSON)."""
    return x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode("utf-8", "surrogatepass")


def bodies(kind: str) -> st.SearchStrategy:
    """Request bodies, a third each: valid ones (every optional field absent or valid), valid
    ones with one or two fields replaced by an edge value or junk, and wild ones (each field
    absent, plausible or junk, `max_tokens` small so no fuzzed request runs for a whole context;
    or a body that is not a JSON object, or not JSON)."""
    wide = CHAT if kind == "chat" else COMPLETION
    valid = st.fixed_dictionaries(REQUIRED[kind], optional=VALID_CHAT if kind == "chat" else VALID_COMPLETION)

    @st.composite
    def mutated(draw):
        body = draw(valid)
        for name in draw(st.lists(st.sampled_from(sorted(wide) + ["unknown_field"]), min_size=1, max_size=2)):
            body[name] = draw(wide.get(name, junk))
        body["max_tokens"] = draw(st.integers(1, 8)) if name != "max_tokens" else body["max_tokens"]
        return body

    wild = st.fixed_dictionaries({"max_tokens": small_limit}, optional={**wide, "unknown_field": junk})
    not_object = junk.map(json.dumps) | st.binary(max_size=30) | st.just('{"messages": [') | st.just(
        '{"a": ' * 600 + "1" + "}" * 600)
    return st.one_of(valid, mutated(), st.one_of(wild, not_object)).map(encode_body)


# Anthropic's Messages API and OpenAI's Responses API (translated to the chat route): their own
# fields, each plausible or junk; max_tokens / max_output_tokens always small.
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": st.sampled_from(["get_weather", ""]) | junk,
                           "input": st.just({"city": "x"}) | junk}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text | junk},
                          optional={"content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                      "text": text})) | junk}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "image", "junk"])},
                          optional={"thinking": text | junk}), junk)
ANTHROPIC = {
    "model": st.just("glm-5.3-tiny") | text | junk, "max_tokens": small_limit | junk,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | junk,
                                                "content": text | st.lists(block, max_size=3) | junk}),
                         max_size=4) | junk,
    "system": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2) | junk,
    "stop_sequences": st.lists(text, max_size=3) | junk, "stream": st.booleans() | junk,
    "temperature": prob | junk, "top_p": prob | junk, "top_k": st.integers(-2, 600) | junk,
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "", "x" * 70]) | junk},
                                            optional={"input_schema": st.just({"type": "object"}) | junk,
                                                      "type": st.sampled_from(["custom", "bash_20250124"])}),
                      max_size=2) | junk,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"]) | junk},
                                         optional={"name": st.sampled_from(["get_weather", "nope"]) | junk}) | junk,
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"]) | junk},
                                      optional={"budget_tokens": small_limit, "display": text}) | junk,
    "output_config": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "max", "x"]) | junk,
                                                         "format": st.just({"type": "json_schema", "schema": {
                                                             "type": "object"}}) | junk}) | junk,
    "metadata": junk,
}
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "tool"]) | junk},
                          optional={"type": st.just("message"), "content": text | st.lists(
                              st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                                              "input_image"]), "text": text}),
                              max_size=2) | junk}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text | junk,
                           "name": st.sampled_from(["get_weather", ""]) | junk}, optional={"arguments": text | junk}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text | junk},
                          optional={"output": text | junk}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"])},
                          optional={"content": st.lists(st.fixed_dictionaries({"type": st.just("reasoning_text"),
                                                                               "text": text | junk}), max_size=2)
                                    | junk}),
    junk)
RESPONSES = {
    "model": st.just("glm-5.3-tiny") | text | junk, "max_output_tokens": small_limit | junk,
    "input": text | st.lists(item, max_size=4) | junk, "instructions": text | junk,
    "temperature": prob | junk, "top_p": prob | junk, "stream": st.booleans() | junk,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | junk,
                                             "name": st.sampled_from(["get_weather", ""]) | junk},
                                            optional={"parameters": st.just({"type": "object"}) | junk}),
                      max_size=2) | junk,
    "tool_choice": st.sampled_from(["auto", "none", "required", "x", {"type": "function", "name": "get_weather"}])
    | junk, "parallel_tool_calls": st.booleans() | junk,
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "low", "high", "x"]) | junk})
    | junk,
    "text": st.fixed_dictionaries({}, optional={"format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "name": "x", "schema": {"type": "object"}},
        {"type": "yaml"}]) | junk}) | junk,
    "store": st.booleans() | junk, "previous_response_id": st.none() | text, "background": st.booleans() | junk,
    "top_logprobs": st.integers(0, 3) | junk, "truncation": st.sampled_from(["disabled", "auto"]) | junk,
    "thinking_token_budget": st.integers(-2, 6) | junk,
    "metadata": junk, "user": text | junk,
}


assert set(RESPONSES) >= set(ResponsesRequest.model_fields)  # a new field is fuzzed too


VALID_ANTHROPIC = {"system": ok_text, "stop_sequences": st.lists(ok_text, max_size=2), "stream": st.booleans(),
                   "temperature": st.floats(0, 1), "top_k": st.sampled_from([1, 5, 50]),
                   "thinking": st.sampled_from([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}]),
                   "output_config": st.sampled_from([{"effort": "low"}, {"effort": "max"}])}
VALID_RESPONSES = {"instructions": ok_text, "stream": st.booleans(), "temperature": st.floats(0, 1),
                   "reasoning": st.sampled_from([{"effort": "none"}, {"effort": "low"}]),
                   "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}])}


def translated_bodies(fields: dict, required: dict, valid_fields: dict, limit: str) -> st.SearchStrategy:
    """Bodies for a translated route, as `bodies`: valid ones, valid ones with one or two fields
    replaced by a value of `fields` (plausible or junk), wild ones (any field, any value), and
    bodies that are not a JSON object; the token limit `limit` is small whenever it is an integer."""
    valid = st.fixed_dictionaries(required, optional=valid_fields)

    @st.composite
    def mutated(draw):
        body = draw(valid)
        for name in draw(st.lists(st.sampled_from(sorted(fields) + ["unknown_field"]), min_size=1, max_size=2)):
            body[name] = draw(fields.get(name, junk))
        if not isinstance(body.get(limit), int) or isinstance(body.get(limit), bool) or body[limit] > 12:
            body[limit] = 8
        return body

    wild = st.fixed_dictionaries({limit: small_limit}, optional={**{k: v for k, v in fields.items() if k != limit},
                                                                 "unknown_field": junk})
    not_object = junk.map(json.dumps) | st.binary(max_size=30) | st.just('{"messages": [')
    return st.one_of(valid, mutated(), st.one_of(wild, not_object)).map(encode_body)


@pytest.fixture(scope="module")
def server():
    app, args, engine = build_server(ARGV)
    with live_server(app) as base_url:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            yield http, engine
    engine.shutdown()


def check(r: httpx.Response, stream_body: str | None) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert err["code"] == r.status_code
        return
    if stream_body is None:
        assert "choices" in r.json()
        return
    events = [line[6:] for line in stream_body.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", stream_body[-300:]
    for e in events[:-1]:
        assert "error" not in json.loads(e), e


def post(http: httpx.Client, path: str, body: bytes) -> None:
    headers = {"content-type": "application/json"}
    with http.stream("POST", path, content=body, headers=headers) as r:
        raw = r.read().decode("utf-8", errors="replace")
        is_stream = r.headers.get("content-type", "").startswith("text/event-stream")
    check(httpx.Response(r.status_code, headers=r.headers, content=raw.encode()) if not is_stream else r,
          raw if is_stream else None)


@FUZZ
@given(body=bodies("chat"))
def test_fuzz_chat_completions(server, body):
    post(server[0], "/v1/chat/completions", body)


@FUZZ
@given(body=bodies("completion"))
def test_fuzz_completions(server, body):
    post(server[0], "/v1/completions", body)


FEWER = settings(FUZZ, max_examples=max(1, EXAMPLES // 3))  # the chat route behind them is fuzzed above


def check_translated(r: httpx.Response, raw: str, anthropic: bool) -> None:
    """2xx: a whole answer, or a stream ending as the API ends one with no error event; 4xx: the
    API's error body. Never a 5xx."""
    assert r.status_code < 500, (r.status_code, raw[:500])
    if r.status_code >= 400:
        body = json.loads(raw)
        if anthropic:
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], body
        else:
            assert body["error"]["code"] == r.status_code and body["error"]["message"], body
        return
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "content" in json.loads(raw) if anthropic else "output" in json.loads(raw)
        return
    kinds = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert kinds and "error" not in kinds, raw[-300:]
    assert kinds[-1] == "message_stop" if anthropic else kinds[-1] in ("response.completed", "response.incomplete")


@FEWER
@given(body=translated_bodies(ANTHROPIC, {"model": st.just("glm-5.3-tiny"), "max_tokens": st.integers(1, 8),
                                          "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                                                      "content": ok_text}),
                                                               min_size=1, max_size=2)},
                              VALID_ANTHROPIC, "max_tokens"))
def test_fuzz_anthropic_messages(server, body):
    with server[0].stream("POST", "/v1/messages", content=body, headers={"content-type": "application/json"}) as r:
        check_translated(r, r.read().decode("utf-8", errors="replace"), anthropic=True)


@FEWER
@given(body=translated_bodies(RESPONSES, {"model": st.just("glm-5.3-tiny"), "max_output_tokens": st.integers(1, 8),
                                          "input": ok_text}, VALID_RESPONSES, "max_output_tokens"))
def test_fuzz_responses(server, body):
    with server[0].stream("POST", "/v1/responses", content=body, headers={"content-type": "application/json"}) as r:
        check_translated(r, r.read().decode("utf-8", errors="replace"), anthropic=False)


def test_server_is_sound_after_fuzzing(server):
    http, engine = server
    deadline = time.monotonic() + 120  # background responses (`background: true`) run on by themselves
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200
    assert not engine.engine.has_unfinished_requests()
    assert engine.engine.audit() == []
    pool = engine.engine.pool
    assert pool.num_free == pool.num_usable_blocks, "KV pages leaked"
