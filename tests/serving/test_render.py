"""vLLM's render routes (serving/api/render.py): `/v1/chat/completions/render` and
`/v1/completions/render` answer the token ids the engine gets for the same request, without
generating — checked against what the engine receives when the request is served (the scripted
engine of tests/serving/test_chat_parsing_api.py, recording its prompts' ids and parameters) —
and a real vllm-router reads them instead of calling `/tokenize`."""

# ruff: noqa: F811 (the tests take the fixtures imported from test_chat_parsing_api as arguments)
from __future__ import annotations

import httpx
import pytest

from serving.api import build_app
from serving.api.chat_output import ChatParsing
from tests.helpers.live_server import live_server
from tests.helpers.router_process import ROUTER, vllm_router
from tests.serving.test_chat_parsing_api import (  # noqa: F401 (fixture: tokenizer)
    MODEL,
    TOOLS,
    ScriptedEngine,
    tokenizer,
)


class RecordingEngine(ScriptedEngine):
    """ScriptedEngine that also records each request's prompt ids and sampling parameters."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.requests: dict[str, tuple[list[int], object]] = {}

    async def generate(self, prompt_token_ids, params, request_id):
        self.requests[request_id] = (list(prompt_token_ids), params)
        async for out in super().generate(prompt_token_ids, params, request_id):
            yield out


@pytest.fixture(scope="module")
def served(tokenizer):
    engine = RecordingEngine(tokenizer)
    parsing = ChatParsing(reasoning_parser="glm45", tool_call_parser="glm47", enable_auto_tool_choice=True)
    app = build_app(engine, tokenizer, MODEL, chat_parsing=parsing, api_key="sk-render",
                    default_sampling={"temperature": 0.6, "top_p": 0.95})
    with live_server(app) as url, httpx.Client(base_url=url, timeout=20,
                                                 headers={"Authorization": "Bearer sk-render"}) as http:
        yield http, engine


def _served_last(engine) -> tuple[list[int], object]:
    return list(engine.requests.values())[-1]


CHATS = [
    {"messages": [{"role": "user", "content": "SCRIPT:plain hi"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "SCRIPT:two_calls w?"}],
     "tools": TOOLS, "reasoning_effort": "low", "max_tokens": 40, "temperature": 0.2, "seed": 7},
    {"messages": [{"role": "user", "content": "SCRIPT:answer"}], "chat_template_kwargs": {"enable_thinking": False},
     "stop": ["zz"], "logit_bias": {"5": 1.5}},
]


@pytest.mark.parametrize("body", CHATS)
def test_chat_render_gives_the_engines_prompt_and_parameters(served, body):
    http, engine = served
    rendered = http.post("/v1/chat/completions/render", json={"model": MODEL, **body})
    assert rendered.status_code == 200, rendered.text
    n = len(engine.requests)
    r = rendered.json()
    assert len(engine.requests) == n  # nothing generated
    assert r["request_id"].startswith("chatcmpl-") and r["model"] == MODEL and r["stream"] is False
    assert http.post("/v1/chat/completions", json={"model": MODEL, **body}).status_code == 200
    ids, params = _served_last(engine)
    assert r["token_ids"] == ids
    sp = r["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["top_p"], sp["seed"], sp["stop"]) == (
        params.max_tokens, params.temperature, params.top_p, params.seed, params.stop)
    assert sp["logit_bias"] == ({str(k): v for k, v in params.logit_bias.items()} if params.logit_bias else None)


def test_completions_render_gives_one_entry_per_prompt(served):
    http, engine = served
    body = {"model": MODEL, "prompt": ["SCRIPT:plain one", "SCRIPT:plain two two"], "max_tokens": 5}
    rendered = http.post("/v1/completions/render", json=body).json()
    assert http.post("/v1/completions", json=body).status_code == 200
    got = list(engine.requests.values())[-2:]
    assert [e["token_ids"] for e in rendered] == [ids for ids, _ in got]
    assert [e["sampling_params"]["max_tokens"] for e in rendered] == [5, 5]
    ids_prompt = http.post("/v1/completions/render", json={"model": MODEL, "prompt": [5, 6, 7]}).json()
    assert [e["token_ids"] for e in ids_prompt] == [[5, 6, 7]]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 5000}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}),
    ("/v1/completions", {"model": MODEL, "prompt": []}),
])
def test_render_refuses_what_the_route_refuses(served, path, body):
    http, engine = served
    n = len(engine.requests)
    rendered, served_answer = http.post(path + "/render", json=body), http.post(path, json=body)
    assert rendered.status_code == served_answer.status_code >= 400
    assert rendered.json()["error"]["param"] == served_answer.json()["error"]["param"]
    assert len(engine.requests) == n
    assert httpx.post(str(http.base_url) + path + "/render", json=body).status_code == 401  # behind the key


@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (the `pd` extra)")
def test_vllm_router_reads_render_instead_of_tokenize(tokenizer):
    # cache_aware asks a worker for the prompt's token ids before routing: with the render routes
    # served it makes one call (render), not two (a render 404, then /tokenize)
    engine = RecordingEngine(tokenizer)
    seen: list[str] = []
    app = build_app(engine, tokenizer, MODEL)

    async def recorded(scope, receive, send):
        if scope["type"] == "http":
            seen.append(scope["path"])
        await app(scope, receive, send)

    with live_server(recorded) as url, vllm_router(["--policy", "cache_aware", "--worker-urls", url]) as (router, _), \
            httpx.Client(base_url=router, timeout=20) as http:
        seen.clear()
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "SCRIPT:plain"}]})
        done = http.post("/v1/completions", json={"model": MODEL, "prompt": "SCRIPT:plain", "max_tokens": 3})
        assert chat.status_code == done.status_code == 200
        assert seen == ["/v1/chat/completions/render", "/v1/chat/completions", "/v1/completions/render",
                        "/v1/completions"]
