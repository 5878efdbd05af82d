"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`;
serving/api/anthropic.py), driven by the `anthropic` SDK over a live server.

The engine is the scripted fake of tests/serving/test_chat_parsing_api.py (a `SCRIPT:<name>` marker
in the prompt picks the text it answers, tokenised by the tiny GLM tokenizer; prompts rendered by
the real GLM-5.3 chat template), with the reasoning and tool-call parsers on. Each Anthropic
request is checked against an independent result: the same conversation written by hand as an
OpenAI chat request through `/v1/chat/completions` — the prompt the engine receives must be the
same token for token, and the answer the same reasoning, text and tool calls — and the SDK's own
parsing of the stream (its `get_final_message()` must equal the non-streamed message)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from serving.api import build_app
from serving.api.chat_output import ChatParsing
from tests.helpers.live_server import live_server
from tests.serving.test_chat_parsing_api import (  # noqa: F401
    WEATHER,
    WEATHER_ARGS,
    ScriptedEngine,
    tokenizer,
)

MODEL = "glm-parsers"
KEY = "sk-test"
# WEATHER as an Anthropic tool
WEATHER_TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
                "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def engine(tokenizer) -> ScriptedEngine:  # noqa: F811
    return ScriptedEngine(tokenizer)


@pytest.fixture(scope="module")
def base_url(engine, tokenizer):  # noqa: F811
    parsing = ChatParsing(reasoning_parser="glm45", tool_call_parser="glm47", enable_auto_tool_choice=True)
    with live_server(build_app(engine, tokenizer, MODEL, chat_parsing=parsing, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def claude(base_url):
    with anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=10) as c:
        yield c


def _prompt(engine, message_id: str) -> str:
    return engine.prompts["chatcmpl-" + message_id.removeprefix("msg_")]


def test_answer_with_reasoning_equals_the_chat_route(claude, oai, engine):
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
                                    ("answer", None, omitted)):
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


def test_errors_use_anthropics_body_and_the_key_is_checked(claude, base_url):
    def post(body, headers=None, path="/v1/messages"):
        return httpx.post(base_url + path, json=body, headers={"x-api-key": KEY} if headers is None else headers)

    ok = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    for body, status, kind, words in [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, 400, "invalid_request_error", "max_tokens"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "'image' block"),
        ({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
         "custom tools"),
        ({**ok, "model": "claude-sonnet"}, 404, "not_found_error", "claude-sonnet"),
        ({**ok, "messages": []}, 400, "invalid_request_error", "messages"),
    ]:
        r = post(body)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == kind and words in err["error"]["message"], err
    r = post(ok, headers={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert post(ok, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert post({k: v for k, v in ok.items() if k != "max_tokens"}, path="/v1/messages/count_tokens").status_code == 200
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
