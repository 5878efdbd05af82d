"""OpenAI's Responses API (`POST /v1/responses`; serving/api/responses.py), driven by the `openai`
SDK over a live server.

The engine is the scripted fake of tests/serving/test_chat_parsing_api.py (a `SCRIPT:<name>` marker
in the prompt picks the text it answers; prompts rendered by the real GLM-5.3 chat template), with
the reasoning and tool-call parsers on. Each request is checked against an independent result:
the same conversation written by hand as a chat completions request — the prompt the engine
receives must be the same token for token, the answer the same reasoning, text and calls — and
the SDK's own stream accumulator (strict about event order and item identity: its
`get_final_response()` must equal the non-streamed response)."""

from __future__ import annotations

import json

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
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}  # the Responses shape: no "function" wrapper


@pytest.fixture(scope="module")
def engine(tokenizer) -> ScriptedEngine:  # noqa: F811
    return ScriptedEngine(tokenizer)


@pytest.fixture(scope="module")
def base_url(engine, tokenizer):  # noqa: F811
    parsing = ChatParsing(reasoning_parser="glm45", tool_call_parser="glm47", enable_auto_tool_choice=True)
    with live_server(build_app(engine, tokenizer, MODEL, chat_parsing=parsing, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=10) as c:
        yield c


def _prompt(engine, response_id: str) -> str:
    return engine.prompts["chatcmpl-" + response_id.removeprefix("resp_")]


def _items(resp) -> list[dict]:
    """Output items without their ids (drawn per request)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in resp.output]


def test_answer_with_reasoning_equals_the_chat_route(client, engine):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="SCRIPT:answer")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "SCRIPT:answer"}])
    assert _prompt(engine, r.id) == engine.prompts[chat.id]
    c = chat.choices[0].message
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == c.reasoning_content and r.output_text == c.content
    assert r.status == "completed" and r.incomplete_details is None and r.store is False
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == chat.usage.total_tokens and r.usage.input_tokens_details.cached_tokens == 0


def test_function_calls_and_their_outputs_as_input_items(client, engine):
    r = client.responses.create(model=MODEL, input="SCRIPT:two_calls weather?", tools=[WEATHER_TOOL])
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call", "function_call"]
    calls = r.output[2:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER_ARGS), ("now", {})]
    # The next turn: the whole conversation as input items (the calls, their outputs, the
    # reasoning item) — its prompt must equal the same history as chat messages.
    follow = client.responses.create(model=MODEL, tools=[WEATHER_TOOL], input=[
        {"role": "user", "content": "SCRIPT:two_calls weather?"},
        *[item.model_dump(exclude_none=True) for item in r.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        {"type": "function_call_output", "call_id": calls[1].call_id, "output": "noon"},
        {"role": "user", "content": [{"type": "input_text", "text": "SCRIPT:answer thanks"}]},
    ])
    chat = client.chat.completions.create(model=MODEL, tools=[WEATHER], messages=[
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


def test_the_streamed_response_equals_the_non_streamed_one(client):
    for kw in ({"input": "SCRIPT:answer"}, {"input": "SCRIPT:two_calls", "tools": [WEATHER_TOOL]},
               {"input": "SCRIPT:plain", "reasoning": {"effort": "none"}}):
        whole = client.responses.create(model=MODEL, **kw)
        with client.responses.stream(model=MODEL, **kw) as stream:
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
    cut = client.responses.create(model=MODEL, input="SCRIPT:answer", max_output_tokens=4)
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == ("incomplete", "max_output_tokens", 4)
    with client.responses.create(model=MODEL, input="SCRIPT:answer", max_output_tokens=4, stream=True) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


def test_reasoning_effort_and_text_format_reach_the_chat_request(client, engine):
    off = client.responses.create(model=MODEL, input="SCRIPT:plain", reasoning={"effort": "none"})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "SCRIPT:plain"}],
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _prompt(engine, off.id) == engine.prompts[chat.id] and _prompt(engine, off.id).endswith("</think>")
    low = client.responses.create(model=MODEL, input="SCRIPT:plain", reasoning={"effort": "low"})
    chat = client.chat.completions.create(model=MODEL, reasoning_effort="low",
                                          messages=[{"role": "user", "content": "SCRIPT:plain"}])
    assert _prompt(engine, low.id) == engine.prompts[chat.id] and "Reasoning Effort: Low" in engine.prompts[chat.id]


def test_what_this_server_does_not_do_is_a_400_naming_it(client, base_url):
    def post(body, key=KEY):
        return httpx.post(base_url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"})

    ok = {"model": MODEL, "input": "hi"}
    for body, param in [({**ok, "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({**ok, "background": True}, "background"),
                        ({**ok, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input.0.content.0"),
                        ({**ok, "tools": [{"type": "web_search"}]}, "tools.0"),
                        ({**ok, "input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
                        ({**ok, "text": {"format": {"type": "yaml"}}}, "text.format")]:
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert post(ok, key="wrong").status_code == 401
    r = httpx.get(base_url + "/v1/responses/resp_1", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "stores no responses" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="hi")
