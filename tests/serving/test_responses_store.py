"""The Responses API's stored responses (serving/api/responses_routes.py, response_store.py):
`previous_response_id`, retrieval, deletion, input items, background runs (polled, streamed,
resumed, cancelled) and the store's bounds, driven by the `openai` SDK over a live server.

The engine is the scripted fake of tests/serving/test_chat_parsing_api.py (a `SCRIPT:<name>` marker
in the prompt picks the answer; prompts rendered by the real GLM-5.3 chat template), plus a `hold`
script that answers one token every few milliseconds until the test releases it, and a record of
the requests the server aborted. The independent result each conversation is checked against is
the same conversation sent whole — as chat messages to `/v1/chat/completions`, or as input items
to a stateless `/v1/responses` request: the prompt the engine receives must be the same, token
for token."""

# ruff: noqa: F811 (the tests take the fixtures imported from test_chat_parsing_api as arguments)
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from serving.api import build_app
from serving.api.chat_output import ChatParsing
from serving.api.response_store import ResponseStore, StoredResponse
from serving.types import RequestOutput
from tests.helpers.live_server import live_server
from tests.helpers.router_process import ROUTER, vllm_router
from tests.serving.test_chat_parsing_api import (  # noqa: F401 (fixture: tokenizer)
    MODEL,
    WEATHER,
    ScriptedEngine,
    tokenizer,
)

WEATHER_FN = {"type": "function", **WEATHER["function"]}


class HoldingEngine(ScriptedEngine):
    """ScriptedEngine, and `SCRIPT:hold`: one token each 5 ms until `release` is set (then EOS).
    `aborted` lists the request ids the server aborted."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.release = threading.Event()
        self.aborted: list[str] = []
        self.held = 0  # tokens the hold script produced

    async def abort(self, request_id: str, finished_reason: str = "abort") -> None:
        self.aborted.append(request_id)

    async def generate(self, prompt_token_ids, params, request_id):
        prompt = self.tokenizer.decode(prompt_token_ids)
        if "SCRIPT:hold" not in prompt:
            async for out in super().generate(prompt_token_ids, params, request_id):
                yield out
            return
        self.prompts[request_id] = prompt
        token = self.tokenizer.encode("a")[0]
        n = 0
        while not self.release.is_set() and n < params.max_tokens - 1:
            await asyncio.sleep(0.005)
            n += 1
            self.held += 1
            yield RequestOutput(request_id=request_id, new_token_ids=[token], finished=False, finish_reason=None,
                                num_prompt_tokens=len(prompt_token_ids), num_cached_tokens=0, num_output_tokens=n)
        yield RequestOutput(request_id=request_id, new_token_ids=[self.eos], finished=True, finish_reason="stop",
                            num_prompt_tokens=len(prompt_token_ids), num_cached_tokens=0, num_output_tokens=n + 1)


def _app(engine, tokenizer, **kw):
    parsing = ChatParsing(reasoning_parser="glm45", tool_call_parser="glm47", enable_auto_tool_choice=True)
    return build_app(engine, tokenizer, MODEL, chat_parsing=parsing, **kw)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return HoldingEngine(tokenizer)


@pytest.fixture(scope="module")
def base_url(engine, tokenizer):
    with live_server(_app(engine, tokenizer)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def _last_prompt(engine) -> str:
    return list(engine.prompts.values())[-1]


def _items(resp) -> list[dict]:
    """Output items without their ids (drawn per request)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in resp.output]


def _wait(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_previous_response_id_continues_the_conversation(oai, engine):
    r1 = oai.responses.create(model=MODEL, instructions="Be brief.", input="SCRIPT:two_calls weather?",
                              tools=[WEATHER_FN])
    assert r1.store is True and r1.previous_response_id is None
    calls = [i for i in r1.output if i.type == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"result {k}"}
               for k, c in enumerate(calls)]
    r2 = oai.responses.create(model=MODEL, previous_response_id=r1.id, tools=[WEATHER_FN],
                              input=[*outputs, {"role": "user", "content": "SCRIPT:answer thanks"}])
    chained = _last_prompt(engine)
    assert r2.previous_response_id == r1.id
    # the same conversation sent whole, stateless; `instructions` are not carried over
    whole = oai.responses.create(model=MODEL, tools=[WEATHER_FN], store=False, input=[
        {"role": "user", "content": "SCRIPT:two_calls weather?"},
        *[item.model_dump(exclude_none=True) for item in r1.output],
        *outputs, {"role": "user", "content": "SCRIPT:answer thanks"}])
    assert chained == _last_prompt(engine) and "Be brief." not in chained
    assert _items(r2) == _items(whole) and whole.store is False
    # and as chat messages
    c = {i.type: i for i in r1.output}
    chat = oai.chat.completions.create(model=MODEL, tools=[WEATHER], messages=[
        {"role": "user", "content": "SCRIPT:two_calls weather?"},
        {"role": "assistant", "content": c["message"].content[0].text, "reasoning_content": c["reasoning"].content[0].text,
         "tool_calls": [{"id": x.call_id, "type": "function", "function": {"name": x.name, "arguments": x.arguments}}
                        for x in calls]},
        *[{"role": "tool", "tool_call_id": o["call_id"], "content": o["output"]} for o in outputs],
        {"role": "user", "content": "SCRIPT:answer thanks"}])
    assert engine.prompts[chat.id] == chained
    # a third turn from a streamed (and stored) second one
    with oai.responses.stream(model=MODEL, previous_response_id=r2.id, input="SCRIPT:plain and now?") as s:
        r3 = s.get_final_response()
    r4 = oai.responses.create(model=MODEL, previous_response_id=r3.id, input="SCRIPT:answer")
    fourth = _last_prompt(engine)
    oai.responses.create(model=MODEL, store=False, input=[
        {"role": "user", "content": "SCRIPT:two_calls weather?"}, *[i.model_dump(exclude_none=True) for i in r1.output],
        *outputs, {"role": "user", "content": "SCRIPT:answer thanks"}, *[i.model_dump(exclude_none=True) for i in r2.output],
        {"role": "user", "content": "SCRIPT:plain and now?"}, *[i.model_dump(exclude_none=True) for i in r3.output],
        {"role": "user", "content": "SCRIPT:answer"}])
    assert fourth == _last_prompt(engine) and r4.status == "completed"


def test_retrieve_delete_and_input_items(oai, base_url):
    r = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"},
                                                 {"role": "user", "content": "SCRIPT:answer three"}])
    got = oai.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = list(oai.responses.input_items.list(r.id, limit=2))  # the SDK follows the cursor
    assert [i.content[0].text for i in items] == ["SCRIPT:answer three", "two", "one"]
    assert len({i.id for i in items}) == 3
    asc = oai.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in asc.data] == ["one", "two"] and asc.has_more
    assert [i.content[0].text for i in oai.responses.input_items.list(r.id, order="asc", after=asc.data[1].id).data] == [
        "SCRIPT:answer three"]
    assert oai.responses.delete(r.id) is None
    for call in (lambda: oai.responses.retrieve(r.id), lambda: oai.responses.delete(r.id),
                 lambda: oai.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=MODEL, previous_response_id=r.id, input="x")
    assert e.value.body["param"] == "previous_response_id"
    kept = oai.responses.create(model=MODEL, input="SCRIPT:plain")
    for query, param in [("order=up", "order"), ("limit=0", "limit"), ("after=msg_nope", "after")]:
        resp = httpx.get(f"{base_url}/v1/responses/{kept.id}/input_items?{query}")
        assert resp.status_code == 400 and param in resp.text, resp.text
    # item ids are unique whatever the client sends (the cursor pages by id)
    odd = oai.responses.create(model=MODEL, input=[
        {"role": "user", "content": "a", "id": None}, {"role": "user", "content": "b", "id": 5},
        {"role": "user", "content": "c", "id": "dup"}, {"role": "user", "content": "SCRIPT:plain", "id": "dup"}])
    listed = list(oai.responses.input_items.list(odd.id, limit=1, order="asc"))
    assert [i.content[0].text for i in listed] == ["a", "b", "c", "SCRIPT:plain"]
    assert len({i.id for i in listed}) == 4 and all(isinstance(i.id, str) and i.id for i in listed)
    assert listed[2].id == "dup"  # a client's id is kept where it is a unique string
    # store: false keeps nothing
    gone = oai.responses.create(model=MODEL, input="SCRIPT:plain", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(gone.id)


def test_a_background_response_is_polled_to_the_same_answer(oai):
    fg = oai.responses.create(model=MODEL, input="SCRIPT:answer", tools=[WEATHER_FN])
    bg = oai.responses.create(model=MODEL, input="SCRIPT:answer", tools=[WEATHER_FN], background=True)
    assert bg.status == "queued" and bg.background is True and bg.output == []
    _wait(lambda: oai.responses.retrieve(bg.id).status == "completed")
    done = oai.responses.retrieve(bg.id)
    assert _items(done) == _items(fg) and done.usage.model_dump() == fg.usage.model_dump()
    with pytest.raises(openai.BadRequestError):  # a foreground response cannot be cancelled
        oai.responses.cancel(fg.id)
    assert oai.responses.cancel(bg.id).status == "completed"  # a finished one is answered as it is


def test_a_background_stream_resumes_where_it_was_left(oai):
    fg = oai.responses.create(model=MODEL, input="SCRIPT:two_calls", tools=[WEATHER_FN])
    with oai.responses.create(model=MODEL, input="SCRIPT:two_calls", tools=[WEATHER_FN], background=True,
                              stream=True) as stream:
        events = list(stream)
    final = events[-1].response
    assert events[-1].type == "response.completed" and _items(final) == _items(fg)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:3]] == ["response.queued", "response.created", "response.in_progress"]
    k = len(events) // 2
    with oai.responses.retrieve(final.id, stream=True, starting_after=k) as again:
        tail = list(again)
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in events[k + 1:]]
    with pytest.raises(openai.BadRequestError):  # not created as a background stream
        oai.responses.retrieve(fg.id, stream=True)


def test_cancelling_a_background_response_aborts_its_request(oai, engine):
    engine.release.clear()
    bg = oai.responses.create(model=MODEL, input="SCRIPT:hold", background=True, max_output_tokens=4000)
    _wait(lambda: oai.responses.retrieve(bg.id).status == "in_progress" and engine.held > 0)
    with pytest.raises(openai.BadRequestError) as e:  # its conversation cannot go on before it ends
        oai.responses.create(model=MODEL, previous_response_id=bg.id, input="x")
    assert e.value.body["param"] == "previous_response_id"
    n_aborted = len(engine.aborted)
    cancelled = oai.responses.cancel(bg.id)
    assert cancelled.status == "cancelled" and oai.responses.retrieve(bg.id).status == "cancelled"
    assert len(engine.aborted) == n_aborted + 1
    held = engine.held
    time.sleep(0.1)
    assert engine.held == held  # nothing more generated
    # a client leaving a background stream does not cancel it; deleting it does
    with oai.responses.create(model=MODEL, input="SCRIPT:hold", background=True, stream=True,
                              max_output_tokens=4000) as stream:
        first = next(iter(stream))
    rid = first.response.id
    time.sleep(0.05)
    assert oai.responses.retrieve(rid).status == "in_progress"
    oai.responses.delete(rid)
    _wait(lambda: len(engine.aborted) == n_aborted + 2)
    engine.release.set()


def test_background_requests_are_checked_before_they_are_queued(oai, engine):
    n = len(engine.prompts)
    for kw, param in [({"input": "SCRIPT:answer " + "word " * 5000}, "messages"),  # past the context
                      ({"input": "x", "store": False}, "store"),
                      ({"input": "x", "tool_choice": "required"}, "tool_choice")]:  # and no tools
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                oai.responses.create(model=MODEL, background=True, stream=stream, **kw)
            assert e.value.body["param"] == param, e.value.body
    assert len(engine.prompts) == n  # none reached the engine


class FailingEngine(ScriptedEngine):
    async def generate(self, prompt_token_ids, params, request_id):
        raise RuntimeError("the device is gone")
        yield  # an async generator


def test_a_background_response_that_fails_says_why(tokenizer):
    with live_server(_app(FailingEngine(tokenizer), tokenizer)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10) as oai:
        bg = oai.responses.create(model=MODEL, input="SCRIPT:answer", background=True)
        _wait(lambda: oai.responses.retrieve(bg.id).status not in ("queued", "in_progress"))
        failed = oai.responses.retrieve(bg.id)
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert "the device is gone" in failed.error.message
        with oai.responses.create(model=MODEL, input="SCRIPT:answer", background=True, stream=True) as stream:
            events = list(stream)
        assert [e.type for e in events] == ["response.queued", "response.failed"]
        assert events[0].response.status == "queued" and events[1].response.error.code == "server_error"


def test_the_store_is_bounded(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with live_server(_app(engine, tokenizer, responses_store_size=2)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10) as oai:
        ids = [oai.responses.create(model=MODEL, input=f"SCRIPT:plain {k}").id for k in range(3)]
        oai.responses.retrieve(ids[1])  # now the most recently used
        oai.responses.create(model=MODEL, input="SCRIPT:plain 3")
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(ids[0])
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(ids[2])
        assert oai.responses.retrieve(ids[1]).id == ids[1]
    # by size: each entry counts its conversation's items as JSON
    store = ResponseStore(max_entries=100, max_bytes=1000)

    def entry(rid, text):
        e = StoredResponse(rid, {"id": rid, "status": "completed", "output": []}, [], [], len(text))
        e.update(e.response)
        return e

    for k in range(3):
        store.put(entry(f"r{k}", "x" * 400))
    assert [store.get(f"r{k}") is not None for k in range(3)] == [False, True, True]
    store.put(entry("big", "x" * 5000))  # larger than the bound: kept alone until the next
    assert len(store) == 1 and store.get("big") is not None
    # a background stream's kept events count too
    streamed = entry("s", "")
    streamed.add_event(0, "e" * 700)
    store.put(entry("t", "x" * 400))
    store.put(streamed)
    assert streamed.nbytes == entry("u", "").nbytes + 700 and store.get("t") is None and store.get("s") is streamed


def test_a_stateless_server(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with live_server(_app(engine, tokenizer, responses_store_size=0)) as url:
        def post(body):
            return httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "SCRIPT:plain", **body})

        r = post({})
        assert r.status_code == 200 and r.json()["store"] is False
        assert httpx.get(url + "/v1/responses/" + r.json()["id"]).status_code == 404
        for body, param in [({"previous_response_id": r.json()["id"]}, "previous_response_id"),
                            ({"background": True}, "background")]:
            resp = post(body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        stream = post({"stream": True}).text
        done = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")][-1]
        assert done["type"] == "response.completed" and done["response"]["store"] is False


@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (the `pd` extra)")
def test_behind_vllm_router_a_response_is_found_on_the_server_that_made_it(tokenizer):
    # vllm-router (0.1.17) remembers which worker answered a response: a retrieval and a
    # `previous_response_id` request go there, whichever worker round_robin would pick next
    engines = [ScriptedEngine(tokenizer), ScriptedEngine(tokenizer)]
    with live_server(_app(engines[0], tokenizer)) as u0, live_server(_app(engines[1], tokenizer)) as u1, \
            vllm_router(["--policy", "round_robin", "--worker-urls", u0, u1]) as (url, _), \
            httpx.Client(base_url=url, timeout=20) as http:
        ids = [http.post("/v1/responses", json={"model": MODEL, "input": f"SCRIPT:plain {k}"}).json()["id"]
               for k in range(4)]
        assert all(e.prompts for e in engines)  # both servers answered some
        for rid in ids:
            assert http.get(f"/v1/responses/{rid}").json()["id"] == rid
            follow = http.post("/v1/responses", json={"model": MODEL, "input": "SCRIPT:answer", "previous_response_id": rid})
            assert follow.status_code == 200 and follow.json()["previous_response_id"] == rid, follow.text
