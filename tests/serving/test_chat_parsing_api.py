"""Reasoning and tool calls through the HTTP API (`--reasoning-parser glm45 --tool-call-parser glm47
--enable-auto-tool-choice`), driven by the `openai` client over a live server.

The engine is a fake that answers with scripted text (a `SCRIPT:<name>` marker in the prompt picks
the script), tokenised with the tiny checkpoint's GLM tokenizer, in which `<think>`, `<tool_call>`,
`<arg_key>`, ... are single added tokens; the prompts are rendered by the real GLM-5.3 chat
template, so the rendered prompt text is checked too."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from glm53.tiny_checkpoint import CHAT_TEMPLATE_PATH, build_tiny_tokenizer
from glm53.tokenizer import GlmTokenizer
from serving.api import build_app
from serving.api.chat_output import ChatParsing
from serving.types import RequestOutput, SamplingParams
from tests.helpers.live_server import live_server

MODEL = "glm-parsers"
HEAD = "[gMASK]<sop><|system|>Reasoning Effort: "

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "units": {"type": "object"},
                "hourly": {"type": "boolean"},
            },
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters at all
TOOLS = [WEATHER, NOW]

SCRIPTS = {
    "two_calls": "The user wants weather; I will call tools.\n</think>\nLet me check."
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>007 Springfield</arg_value>"
    '<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>units</arg_key><arg_value>{"temp": "C"}</arg_value>'
    "<arg_key>hourly</arg_key><arg_value>true</arg_value></tool_call>\n<tool_call>now</tool_call>",
    "answer": "Simple.</think>It is sunny, 21 °C. 你好 🙂",
    "malformed": "Hmm</think>Calling <tool_call>get_weather<arg_key>city</arg_key></tool_call> oops",
    "no_end_tag": "I keep thinking and never stop thinking",
    "plain": "Plain answer with <tool_call>now</tool_call> markup",
    # line and paragraph separators that str.splitlines() would split at (JSON carries them raw)
    "separators": "Think\u2028this</think>One\u2028two\u2029three\u0085four",
}


class ScriptedEngine:
    """An `EngineClient` that answers the prompt's `SCRIPT:<name>` with SCRIPTS[name] then EOS,
    one or two tokens per increment (finish "length" when max_tokens cuts it)."""

    model_name = "scripted"

    def __init__(self, tokenizer: GlmTokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 4096
        self.eos = tokenizer.eos_token_id
        self.prompts: dict[str, str] = {}

    def is_healthy(self) -> bool:
        return True

    async def abort(self, request_id: str, finished_reason: str = "abort") -> None:
        pass

    async def generate(self, prompt_token_ids, params: SamplingParams, request_id: str):
        prompt = self.tokenizer.decode(prompt_token_ids)
        self.prompts[request_id] = prompt
        found = re.findall(r"SCRIPT:(\w+)", prompt)
        seq = self.tokenizer.encode(SCRIPTS[found[-1]] if found else "ok") + [self.eos]
        seq = seq[: params.max_tokens]
        pos, step = 0, 0
        while pos < len(seq):
            await asyncio.sleep(0)
            new = seq[pos : pos + 1 + step % 2]
            pos += len(new)
            step += 1
            done = pos >= len(seq)
            yield RequestOutput(
                request_id=request_id,
                new_token_ids=new,
                finished=done,
                finish_reason=("stop" if new[-1] == self.eos else "length") if done else None,
                num_prompt_tokens=len(prompt_token_ids),
                num_cached_tokens=0,
                num_output_tokens=pos,
            )


def parsing_app(engine: ScriptedEngine, tokenizer: GlmTokenizer, api_key: str | None = None):
    """The API over `engine` with the glm45 reasoning and glm47 tool-call parsers on (auto tool choice)."""
    parsing = ChatParsing(reasoning_parser="glm45", tool_call_parser="glm47", enable_auto_tool_choice=True)
    return build_app(engine, tokenizer, MODEL, chat_parsing=parsing, api_key=api_key)


@pytest.fixture(scope="module")
def tokenizer() -> GlmTokenizer:
    return GlmTokenizer(
        build_tiny_tokenizer(),
        tokenizer_config={"eos_token": "<|endoftext|>"},
        chat_template=CHAT_TEMPLATE_PATH.read_text(),
    )


@pytest.fixture(scope="module")
def engine(tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tokenizer)


@pytest.fixture(scope="module")
def base_url(engine, tokenizer):
    with live_server(parsing_app(engine, tokenizer)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=10) as c:
        yield c


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"SCRIPT:{script}"}]


def accumulate(stream) -> dict:
    """Fold `chat.completion.chunk`s as an OpenAI client does."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "n_reasoning_chunks": 0}
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            r = getattr(d, "reasoning_content", None)
            if r:
                out["reasoning"] += r
                out["n_reasoning_chunks"] += 1
            out["content"] += d.content or ""
            for tc in d.tool_calls or []:
                slot = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    slot["id"], slot["name"] = tc.id, tc.function.name
                    assert tc.type == "function"
                slot["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                assert out["finish"] is None
                out["finish"] = choice.finish_reason
    return out


WEATHER_ARGS = {"city": "007 Springfield", "days": 3, "units": {"temp": "C"}, "hourly": True}


def test_tool_calls_non_stream(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=ask("two_calls"), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.reasoning_content == "The user wants weather; I will call tools."
    assert msg.content == "Let me check."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "now"]
    assert json.loads(msg.tool_calls[0].function.arguments) == WEATHER_ARGS
    assert json.loads(msg.tool_calls[1].function.arguments) == {}
    assert all(c.type == "function" and c.id.startswith("call_") for c in msg.tool_calls)
    # The tools reached the prompt through the chat template's tools block.
    prompt = engine.prompts[r.id]
    assert prompt.startswith(HEAD + "Max<|system|>\n# Tools\n")
    assert json.dumps(WEATHER["function"], ensure_ascii=False) + "\n" in prompt
    assert prompt.endswith("<|user|>SCRIPT:two_calls<|assistant|><think>")


def test_tool_calls_stream(client):
    stream = client.chat.completions.create(model=MODEL, messages=ask("two_calls"), tools=TOOLS, stream=True)
    got = accumulate(stream)
    assert got["reasoning"] == "The user wants weather; I will call tools."
    assert got["n_reasoning_chunks"] > 3  # streamed, not sent at the end
    assert got["content"] == "Let me check."
    assert sorted(got["calls"]) == [0, 1]
    assert got["calls"][0]["name"] == "get_weather" and json.loads(got["calls"][0]["arguments"]) == WEATHER_ARGS
    assert got["calls"][1]["name"] == "now" and got["calls"][1]["arguments"] == "{}"
    assert got["calls"][0]["id"] != got["calls"][1]["id"]
    assert got["finish"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(client, stream):
    kw = dict(model=MODEL, messages=ask("two_calls"), tools=TOOLS, parallel_tool_calls=False)
    if stream:
        got = accumulate(client.chat.completions.create(stream=True, **kw))
        calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())]
        content, finish = got["content"], got["finish"]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        content, finish = choice.message.content, choice.finish_reason
    assert calls == [("get_weather", WEATHER_ARGS)]
    assert (content, finish) == ("Let me check.", "tool_calls")


def test_raw_sse_tool_call_chunks(base_url):
    body = {"model": MODEL, "messages": ask("two_calls"), "tools": TOOLS, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=10) as resp:
        events = resp.read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    deltas = [json.loads(e.removeprefix("data: "))["choices"][0]["delta"] for e in events[:-2]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    # per call: a header with index, id, type and name (empty arguments), then the arguments
    assert [sorted(c) for c in calls] == [["function", "id", "index", "type"], ["function", "index"]] * 2
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    assert all(set(d) <= {"role", "content", "reasoning_content", "tool_calls"} for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_content_without_tools(client, stream):
    kw = dict(model=MODEL, messages=ask("answer"))
    if stream:
        got = accumulate(client.chat.completions.create(stream=True, **kw))
    else:
        m = client.chat.completions.create(**kw).choices[0]
        got = {"reasoning": m.message.reasoning_content, "content": m.message.content, "finish": m.finish_reason,
               "calls": m.message.tool_calls or {}}
    assert (got["reasoning"], got["content"], got["finish"]) == ("Simple.", "It is sunny, 21 °C. 你好 🙂", "stop")
    assert not got["calls"]


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_call_is_returned_as_content(client, stream):
    kw = dict(model=MODEL, messages=ask("malformed"), tools=TOOLS)
    text = "Calling <tool_call>get_weather<arg_key>city</arg_key></tool_call> oops"
    if stream:
        got = accumulate(client.chat.completions.create(stream=True, **kw))
        assert (got["reasoning"], got["content"], got["calls"], got["finish"]) == ("Hmm", text, {}, "stop")
    else:
        m = client.chat.completions.create(**kw).choices[0]
        assert (m.message.reasoning_content, m.message.content, m.finish_reason) == ("Hmm", text, "stop")
        assert not m.message.tool_calls


def test_missing_end_tag_and_length(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("no_end_tag"))
    assert r.choices[0].message.reasoning_content == "I keep thinking and never stop thinking"
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=ask("two_calls"), tools=TOOLS, max_tokens=12)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    assert r.choices[0].message.reasoning_content and not r.choices[0].message.tool_calls


def test_thinking_disabled_and_effort(client, engine):
    r = client.chat.completions.create(
        model=MODEL, messages=ask("plain"), reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert engine.prompts[r.id] == HEAD + "Low<|user|>SCRIPT:plain<|assistant|><think></think>"
    # no tools in the request: tool markup is left in the content
    assert r.choices[0].message.content == SCRIPTS["plain"]
    assert r.choices[0].message.reasoning_content is None


def test_tool_choice_none_renders_no_tools_and_parses_none(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=ask("plain"), tools=TOOLS, tool_choice="none")
    assert "# Tools" not in engine.prompts[r.id]
    # the prompt opened the reasoning and the output never closed it: all reasoning
    assert r.choices[0].message.reasoning_content == SCRIPTS["plain"]
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


def test_multi_turn_history_with_tool_calls(client, engine):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
        {"role": "assistant", "content": "Sunny, 21 degrees."},
        {"role": "user", "content": "SCRIPT:answer"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], reasoning_effort="high")
    prompt = engine.prompts[r.id]
    tools_end = prompt.index("</tool_call>", prompt.index("<tools>")) + len("</tool_call>")
    assert prompt[:tools_end].startswith(HEAD + "High<|system|>\n# Tools\n")
    assert prompt[tools_end:] == (
        "<|system|>Be brief.<|user|>Weather in Paris?"
        "<|assistant|><think>Need the tool.</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>now</tool_call>"
        '<|observation|><tool_response>{"temp": 21}</tool_response><tool_response>12:00</tool_response>'
        "<|assistant|><think></think>Sunny, 21 degrees.<|user|>SCRIPT:answer<|assistant|><think>"
    )
    assert r.choices[0].message.content == "It is sunny, 21 °C. 你好 🙂"


# ---------------------------------------------------------------------------------------- errors


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": ask("answer"), **fields}


@pytest.mark.parametrize(
    "body, param, words",
    [
        (_chat(tool_choice="required"), "tool_choice", "needs tools"),
        (_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "later"}}), "tool_choice",
         "not among"),
        (_chat(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice", "named"),
        (_chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "auto"),
        (_chat(tools=[{"type": "retrieval"}]), "tools", "function"),
        (_chat(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools", "name"),
        (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools", "parameters"),
        (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), "tools",
         '"object"'),
        # a forced call compiles the whole parameters schema, not only its properties' schemas
        (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": ["object", "bogus"]}}}],
               tool_choice="required"), "tools", "tools[0].function.parameters is not a valid JSON schema"),
        (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                                  "minProperties": "x"}}}],
               tool_choice={"type": "function", "function": {"name": "f"}}), "tools", "minProperties"),
        (_chat(tools="not a list"), "tools", "list"),
        (_chat(reasoning_effort="extreme"), "reasoning_effort", "extreme"),
        (_chat(tools=TOOLS, parallel_tool_calls="sometimes"), "parallel_tool_calls", "bool"),
        (
            {"model": MODEL, "messages": [
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "now", "arguments": "{bad"}}]},
                {"role": "user", "content": "x"}]},
            "messages", "JSON",
        ),
    ],
)
def test_bad_tool_requests_400(client, base_url, body, param, words):
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and words in err["message"], err
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**body)
    # and the server keeps serving
    assert client.chat.completions.create(model=MODEL, messages=ask("answer")).choices[0].message.content


def test_tools_need_auto_tool_choice_on_the_server(engine, tokenizer):
    plain = build_app(engine, tokenizer, MODEL)  # no parsers configured
    with TestClient(plain) as tc:
        r = tc.post("/v1/chat/completions", json=_chat(tools=TOOLS))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = tc.post("/v1/chat/completions", json=_chat(tools=TOOLS, tool_choice="none"))
        assert r.status_code == 200
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == SCRIPTS["answer"] and msg["reasoning_content"] is None  # raw text
        assert r.json()["usage"]["completion_tokens_details"] is None  # no reasoning counted without a parser


def test_reasoning_tokens_are_the_first_blocks_as_the_parser_reads_it():
    """On token ids, as the glm45 parser splits text: one block, from the prompt's `<think>` (or a
    first output `<think>`) to the first `</think>`; later tags are content."""
    from serving.parsers.reasoning import count_reasoning_tokens

    S, E, a, b = 1, 2, 10, 11
    cases = [([a, a, E, b], True, 2), ([a, E, S, b, b], True, 1), ([E, S, a, a], False, 0), ([a, S, a, E], False, 0),
             ([S, a, b, E, S, a], False, 2), ([S, a, b], False, 2), ([a, b, a], True, 3), ([S, a, E], True, 1)]
    for ids, opens, want in cases:
        assert count_reasoning_tokens(ids, opens, S, E) == want, (ids, opens)


def test_usage_counts_the_reasoning_tokens(client, tokenizer):
    # the tokens of the think block: the script's text before </think>, tokenised on its own
    # (</think> is one added token, so the engine's ids split there)
    think = len(tokenizer.encode(SCRIPTS["answer"].split("</think>")[0]))
    r = client.chat.completions.create(model=MODEL, messages=ask("answer"))
    assert r.usage.completion_tokens_details.reasoning_tokens == think > 0
    assert len(tokenizer.encode(r.choices[0].message.reasoning_content)) == think
    two = client.chat.completions.create(model=MODEL, messages=ask("answer"), n=2)
    assert two.usage.completion_tokens_details.reasoning_tokens == 2 * think
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask("answer"), stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == think
    cut = client.chat.completions.create(model=MODEL, messages=ask("answer"), max_tokens=2)  # inside the block
    assert cut.usage.completion_tokens_details.reasoning_tokens == 2
    off = client.chat.completions.create(model=MODEL, messages=ask("answer"),
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0  # the prompt closed the block
