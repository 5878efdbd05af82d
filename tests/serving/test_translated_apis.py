"""The APIs served by translation to the chat route — Anthropic's Messages API (`POST /v1/messages`,
`/v1/messages/count_tokens`; serving/api/anthropic.py) and OpenAI's Responses API
(`POST /v1/responses`; serving/api/responses.py; its stored responses: test_responses_store.py) — driven by the `anthropic` and `openai` SDKs over
a live server.

The engine is the scripted fake of tests/serving/test_chat_parsing_api.py (a `SCRIPT:<name>` marker
in the prompt picks the text it answers, tokenised by the tiny GLM tokenizer; prompts rendered by
the real GLM-5.3 chat template), with the reasoning and tool-call parsers on. Each request is
checked against an independent result: the same conversation written by hand as an OpenAI chat
request through `/v1/chat/completions` — the prompt the engine receives must be the same token for
token, and the answer the same reasoning, text and tool calls — and the SDKs' own parsing of the
streams (the folded stream must equal the non-streamed answer; the event structure is checked
too)."""

# ruff: noqa: F811 (the tests take the fixtures imported from test_chat_parsing_api as arguments)
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.helpers.live_server import live_server
from tests.serving.test_chat_parsing_api import (  # noqa: F401 (fixtures: tokenizer, engine, base_url)
    MODEL,
    WEATHER,
    WEATHER_ARGS,
    base_url,
    engine,
    parsing_app,
    tokenizer,
)

KEY = "sk-test"  # the API key of the server the key checks build
# WEATHER as an Anthropic tool, and in the Responses shape (no "function" wrapper)
WEATHER_TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
                "input_schema": WEATHER["function"]["parameters"]}
WEATHER_FN = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def claude(base_url):
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def _prompt(engine, answer_id: str) -> str:
    """The prompt the engine got for a message (`msg_…`) or response (`resp_…`) id."""
    return engine.prompts["chatcmpl-" + answer_id.removeprefix("msg_").removeprefix("resp_")]


# ------------------------------------------------------------------------ Anthropic's Messages API

def test_message_with_reasoning_equals_the_chat_route(claude, oai, engine):
    msg = claude.messages.create(model=MODEL, max_tokens=200, system="Be brief.",
                                 messages=[{"role": "user", "content": "SCRIPT:answer"}])
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "SCRIPT:answer"}])
    assert _prompt(engine, msg.id) == engine.prompts[chat.id]
    c = chat.choices[0].message
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert (msg.content[0].thinking, msg.content[1].text) == (c.reasoning_content, c.content)
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None and msg.role == "assistant"
    # Anthropic's usage split: tokens not read from the prefix cache + those read (none here)
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens) == (chat.usage.prompt_tokens, 0)
    assert msg.usage.output_tokens == chat.usage.completion_tokens


def test_tool_use_and_a_tool_result_turn(claude, oai, engine):
    msg = claude.messages.create(model=MODEL, max_tokens=300, tools=[WEATHER_TOOL],
                                 messages=[{"role": "user", "content": "SCRIPT:two_calls weather?"}])
    assert msg.stop_reason == "tool_use"
    kinds = [b.type for b in msg.content]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"], kinds
    call = msg.content[2]
    assert (call.name, call.input) == ("get_weather", WEATHER_ARGS)
    assert (msg.content[3].name, msg.content[3].input) == ("now", {})
    # The next turn sends the calls back with their results; its prompt must equal the same
    # history written as OpenAI chat messages (assistant tool_calls, then tool messages).
    follow = claude.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "SCRIPT:two_calls weather?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
            {"type": "tool_result", "tool_use_id": msg.content[3].id, "content": [{"type": "text", "text": "noon"}]},
            {"type": "text", "text": "SCRIPT:answer thanks"}]},
    ])
    chat = oai.chat.completions.create(model=MODEL, tools=[WEATHER], messages=[
        {"role": "user", "content": "SCRIPT:two_calls weather?"},
        {"role": "assistant", "content": msg.content[1].text, "reasoning_content": msg.content[0].thinking,
         "tool_calls": [{"id": b.id, "type": "function",
                         "function": {"name": b.name, "arguments": json.dumps(b.input)}} for b in msg.content[2:]]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        {"role": "tool", "tool_call_id": msg.content[3].id, "content": "noon"},
        {"role": "user", "content": "SCRIPT:answer thanks"},
    ])
    assert _prompt(engine, follow.id) == engine.prompts[chat.id]
    assert "sunny" in engine.prompts[chat.id] and follow.content[-1].text == chat.choices[0].message.content


def test_streamed_message_equals_the_non_streamed_one(claude):
    omitted = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    for script, tools, thinking in (("answer", None, None), ("two_calls", [WEATHER_TOOL], None),
                                    ("answer", None, omitted), ("separators", None, None)):
        kwargs = {"model": MODEL, "max_tokens": 300, "messages": [{"role": "user", "content": f"SCRIPT:{script}"}]}
        if tools:
            kwargs["tools"] = tools
        if thinking:
            kwargs["thinking"] = thinking
        whole = claude.messages.create(**kwargs)
        with claude.messages.stream(**kwargs) as stream:
            raw = [e for e in stream if not e.type.startswith(("text", "thinking", "input_json"))]  # SDK's own
            streamed = stream.get_final_message()
        events = [e.type for e in raw]
        assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
        # one block at a time: start, its deltas, stop; as many blocks as the message has
        block_events = [(e.type, e.index) for e in raw if e.type.startswith("content_block")]
        expect = []
        for i in range(len(streamed.content)):
            n = sum(1 for t, j in block_events if t == "content_block_delta" and j == i)
            expect += [("content_block_start", i)] + [("content_block_delta", i)] * n + [("content_block_stop", i)]
        assert block_events == expect
        def blocks(m):  # tool call ids are drawn per request
            return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in m.content]

        assert blocks(streamed) == blocks(whole)
        assert all(b.id.startswith("call_") for b in streamed.content if b.type == "tool_use")
        assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
        assert streamed.usage.input_tokens == whole.usage.input_tokens


def test_a_forced_tool_without_thinking_asked_for_renders_thinking_off(claude, oai, engine):
    msg = claude.messages.create(model=MODEL, max_tokens=50, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                                 messages=[{"role": "user", "content": "SCRIPT:plain"}])
    chat = oai.chat.completions.create(model=MODEL, tools=[WEATHER], tool_choice="required", max_tokens=50,
                                       messages=[{"role": "user", "content": "SCRIPT:plain"}],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _prompt(engine, msg.id) == engine.prompts[chat.id] and _prompt(engine, msg.id).endswith("</think>")


def test_stop_reasons_thinking_off_and_count_tokens(claude, oai, engine):
    cut = claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "SCRIPT:answer"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    stop = claude.messages.create(model=MODEL, max_tokens=200, stop_sequences=["sunny"],
                                  messages=[{"role": "user", "content": "SCRIPT:answer"}])
    assert (stop.stop_reason, stop.stop_sequence) == ("stop_sequence", "sunny")
    assert stop.content[-1].text == "It is"
    off = claude.messages.create(model=MODEL, max_tokens=50, thinking={"type": "disabled"},
                                 messages=[{"role": "user", "content": "SCRIPT:plain"}])
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "SCRIPT:plain"}],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _prompt(engine, off.id) == engine.prompts[chat.id] and _prompt(engine, off.id).endswith("</think>")
    effort = claude.messages.create(model=MODEL, max_tokens=50, output_config={"effort": "low"},
                                    thinking={"type": "adaptive", "display": "omitted"},
                                    messages=[{"role": "user", "content": "SCRIPT:answer"}])
    chat = oai.chat.completions.create(model=MODEL, reasoning_effort="low",
                                       messages=[{"role": "user", "content": "SCRIPT:answer"}])
    assert _prompt(engine, effort.id) == engine.prompts[chat.id] and "Reasoning Effort: Low" in engine.prompts[chat.id]
    assert (effort.content[0].type, effort.content[0].thinking) == ("thinking", "")  # display: omitted
    assert effort.content[1].text == chat.choices[0].message.content
    # a last assistant turn is a prefilled answer the model continues
    pre = claude.messages.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": "SCRIPT:plain"}, {"role": "assistant", "content": "Sure:"}])
    chat = oai.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "SCRIPT:plain"}, {"role": "assistant", "content": "Sure:"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert _prompt(engine, pre.id) == engine.prompts[chat.id] and engine.prompts[chat.id].endswith("Sure:")
    n = claude.messages.count_tokens(model=MODEL, tools=[WEATHER_TOOL], system="Be brief.",
                                     messages=[{"role": "user", "content": "SCRIPT:answer"}])
    with_tools = oai.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "SCRIPT:answer"}])
    assert n.input_tokens == with_tools.usage.prompt_tokens


def test_errors_use_anthropics_body(claude, base_url):
    def post(body, path="/v1/messages"):
        return httpx.post(base_url + path, json=body)

    ok = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    for body, status, kind, words in [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, 400, "invalid_request_error", "max_tokens"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "'image' block"),
        ({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
         "custom tools"),
        ({**ok, "model": "claude-sonnet"}, 404, "not_found_error", "claude-sonnet"),
        ({**ok, "messages": []}, 400, "invalid_request_error", "messages"),
        ({**ok, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "text", "text": "Let me"}, {"type": "tool_use", "id": "t1", "name": "now", "input": {}}]}]},
         400, "invalid_request_error", "tool_result"),
        ({**ok, "tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}, "thinking": {"type": "enabled",
                                                                                    "budget_tokens": 1024}},
         400, "invalid_request_error", "forces tool use"),
    ]:
        r = post(body)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == kind and words in err["error"]["message"], err
    assert post({k: v for k, v in ok.items() if k != "max_tokens"}, path="/v1/messages/count_tokens").status_code == 200
    # any path or method under /v1/messages answers in Anthropic's body
    for r, status in ((httpx.get(base_url + "/v1/messages"), 405), (post(ok, path="/v1/messages/batches"), 404)):
        assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["type"], r.text
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])


def test_the_api_key_is_checked_on_both_routes(engine, tokenizer):
    # Anthropic clients send the key as x-api-key (or as a bearer token); OpenAI's as a bearer token.
    message = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    response = {"model": MODEL, "input": "hi", "max_output_tokens": 5}
    with live_server(parsing_app(engine, tokenizer, api_key=KEY)) as url:
        for headers, status in [({}, 401), ({"x-api-key": "wrong"}, 401), ({"x-api-key": KEY}, 200),
                                ({"Authorization": f"Bearer {KEY}"}, 200)]:
            r = httpx.post(url + "/v1/messages", json=message, headers=headers)
            assert r.status_code == status, r.text
            if status == 401:
                assert r.json()["error"]["type"] == "authentication_error"
        for headers, status in [({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                ({"Authorization": f"Bearer {KEY}"}, 200)]:
            assert httpx.post(url + "/v1/responses", json=response, headers=headers).status_code == status


# ------------------------------------------------------------------------ OpenAI's Responses API


def _items(resp) -> list[dict]:
    """Output items without their ids (drawn per request)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in resp.output]


def test_response_with_reasoning_equals_the_chat_route(oai, engine):
    r = oai.responses.create(model=MODEL, instructions="Be brief.", input="SCRIPT:answer")
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "SCRIPT:answer"}])
    assert _prompt(engine, r.id) == engine.prompts[chat.id]
    c = chat.choices[0].message
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == c.reasoning_content and r.output_text == c.content
    assert r.status == "completed" and r.incomplete_details is None and r.store is True  # stored by default
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == chat.usage.total_tokens and r.usage.input_tokens_details.cached_tokens == 0
    reasoning = chat.usage.completion_tokens_details.reasoning_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == reasoning > 0


def test_response_function_calls_and_their_outputs_as_input_items(oai, engine):
    r = oai.responses.create(model=MODEL, input="SCRIPT:two_calls weather?", tools=[WEATHER_FN])
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call", "function_call"]
    calls = r.output[2:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER_ARGS), ("now", {})]
    # The next turn: the whole conversation as input items (the calls, their outputs, the
    # reasoning item) — its prompt must equal the same history as chat messages.
    follow = oai.responses.create(model=MODEL, tools=[WEATHER_FN], input=[
        {"role": "user", "content": "SCRIPT:two_calls weather?"},
        *[item.model_dump(exclude_none=True) for item in r.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        {"type": "function_call_output", "call_id": calls[1].call_id, "output": "noon"},
        {"role": "user", "content": [{"type": "input_text", "text": "SCRIPT:answer thanks"}]},
    ])
    chat = oai.chat.completions.create(model=MODEL, tools=[WEATHER], messages=[
        {"role": "user", "content": "SCRIPT:two_calls weather?"},
        {"role": "assistant", "content": r.output[1].content[0].text, "reasoning_content": r.output[0].content[0].text,
         "tool_calls": [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"},
        {"role": "tool", "tool_call_id": calls[1].call_id, "content": "noon"},
        {"role": "user", "content": "SCRIPT:answer thanks"},
    ])
    assert _prompt(engine, follow.id) == engine.prompts[chat.id]
    assert follow.output_text == chat.choices[0].message.content


def test_the_streamed_response_equals_the_non_streamed_one(oai):
    for kw in ({"input": "SCRIPT:answer"}, {"input": "SCRIPT:two_calls", "tools": [WEATHER_FN]},
               {"input": "SCRIPT:plain", "reasoning": {"effort": "none"}}, {"input": "SCRIPT:separators"}):
        whole = oai.responses.create(model=MODEL, **kw)
        with oai.responses.stream(model=MODEL, **kw) as stream:
            raw = list(stream)
            streamed = stream.get_final_response()
        events = [e.type for e in raw]
        assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
        assert [e.sequence_number for e in raw] == list(range(len(raw)))
        # each item between its added and done events, one item at a time; the done items are the output
        opened = [e.output_index for e in raw if e.type == "response.output_item.added"]
        done = [e for e in raw if e.type == "response.output_item.done"]
        assert opened == [e.output_index for e in done] == list(range(len(streamed.output)))
        assert [e.item.model_dump(exclude_none=True) for e in done] == [i.model_dump(exclude_none=True) for i in streamed.output]
        for e in raw:
            if hasattr(e, "output_index") and e.type != "response.output_item.added":
                last_added = max(i for i, ev in enumerate(raw) if ev.type == "response.output_item.added"
                                 and ev.output_index == e.output_index)
                assert raw.index(e) > last_added and all(
                    d.output_index != e.output_index or raw.index(d) >= raw.index(e) for d in done), e.type
        assert _items(streamed) == _items(whole)
        assert streamed.usage.model_dump() == whole.usage.model_dump()
    # cut by max_output_tokens: status incomplete, and the stream ends with response.incomplete
    for n in (4, 12):  # cut inside the reasoning, inside the text
        cut = oai.responses.create(model=MODEL, input="SCRIPT:answer", max_output_tokens=n)
        assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == (
            "incomplete", "max_output_tokens", n)
        assert [i.status for i in cut.output] == ["completed", "incomplete"]  # the last item
        with oai.responses.create(model=MODEL, input="SCRIPT:answer", max_output_tokens=n, stream=True) as stream:
            events = list(stream)
        last = events[-1]
        assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
        assert _items(last.response) == _items(cut)
        assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["completed", "incomplete"]


def test_reasoning_items_open_the_next_assistant_turn(oai, engine):
    def reasoning(text):
        return {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    def said(text):
        return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}

    call = {"type": "function_call", "call_id": "call_1", "name": "now", "arguments": "{}"}
    cases = [  # (input items, the same as chat messages)
        ([said("A1"), reasoning("R2"), said("A2")],
         [{"role": "assistant", "content": "A1"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]),
        ([reasoning("R1"), said("M"), reasoning("R2"), call, {"type": "function_call_output", "call_id": "call_1",
                                                              "output": "noon"}],
         [{"role": "assistant", "content": "M", "reasoning_content": "R1"},
          {"role": "assistant", "content": None, "reasoning_content": "R2", "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]),
    ]
    # reasoning with no answer after it belongs to no later turn
    cases.append(([reasoning("R1"), {"role": "user", "content": "b"}, said("x")],
                  [{"role": "user", "content": "b"}, {"role": "assistant", "content": "x"}]))
    for items, chat_messages in cases:
        r = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "q"}, *items,
                                                     {"role": "user", "content": "SCRIPT:plain"}])
        chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}, *chat_messages,
                                                                  {"role": "user", "content": "SCRIPT:plain"}])
        assert _prompt(engine, r.id) == engine.prompts[chat.id]


def test_response_reasoning_effort_reaches_the_chat_request(oai, engine):
    off = oai.responses.create(model=MODEL, input="SCRIPT:plain", reasoning={"effort": "none"})
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "SCRIPT:plain"}],
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _prompt(engine, off.id) == engine.prompts[chat.id] and _prompt(engine, off.id).endswith("</think>")
    low = oai.responses.create(model=MODEL, input="SCRIPT:plain", reasoning={"effort": " Low"})  # as chat reads it
    chat = oai.chat.completions.create(model=MODEL, reasoning_effort="low",
                                          messages=[{"role": "user", "content": "SCRIPT:plain"}])
    assert _prompt(engine, low.id) == engine.prompts[chat.id] and "Reasoning Effort: Low" in engine.prompts[chat.id]


def test_responses_what_this_server_does_not_do_is_a_400_naming_it(oai, base_url):
    def post(body):
        return httpx.post(base_url + "/v1/responses", json=body)

    ok = {"model": MODEL, "input": "hi"}
    for body, param in [({**ok, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input.0.content.0"),
                        ({**ok, "tools": [{"type": "web_search"}]}, "tools.0"),
                        ({**ok, "input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
                        ({**ok, "text": {"format": {"type": "yaml"}}}, "text.format"),
                        ({**ok, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
                        ({**ok, "max_output_tokens": 0}, "max_output_tokens"), ({**ok, "input": []}, "input"),
                        ({**ok, "reasoning": {"effort": "huge"}}, "reasoning.effort"),
                        ({**ok, "input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]},
                         "input.0.content"),
                        ({**ok, "input": [{"type": "reasoning", "content": 5}]}, "input.0.content"),
                        ({**ok, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 1}]},
                         "input.0")]:
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # (previous_response_id, background and the stored responses' routes: test_responses_store.py)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-5", input="hi")


def test_a_responses_thinking_budget_reaches_the_chat_request():
    # vLLM's extension field, as on chat and completions (the engine enforces it: test_penalties.py)
    from serving.api.responses import ResponsesRequest, to_chat_request

    assert to_chat_request(ResponsesRequest(input="x", thinking_token_budget=3)).thinking_token_budget == 3
    assert to_chat_request(ResponsesRequest(input="x")).thinking_token_budget is None


def test_a_chat_answer_that_is_not_a_stream_passes_through():
    # the chat route answers 499 (a plain response) when the client left before the first
    # output: a streamed translation must hand it on, not read a stream from it
    from fastapi.responses import Response

    from serving.api.streaming import translated_answer

    gone = Response(status_code=499)
    for stream in (True, False):
        assert translated_answer(gone, stream, whole=None) is gone
