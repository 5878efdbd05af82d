"""The real server (`serving.run.build_server`) on the embedded tiny checkpoint, driven by the
`openai` client over loopback: multi-turn chat, streaming, concurrent batching vs one-by-one,
seeds, errors, client disconnects — and the block-pool audit at the end."""

import concurrent.futures as cf
import gc
import json
import os
import time
import weakref

import httpx
import openai
import pytest

from serving.run import build_server
from tests.helpers.live_server import live_server

# Same engine settings as test_llm (shared compiled steps through the persistent cache).
ARGV = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "1024", "--enable-prefix-caching",
        "--log-level", "warning", "--cuda-graph-sizes", "--precompile-token-paddings"]  # one step bucket (64 tokens): keeps tests fast


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("trace")


@pytest.fixture(scope="module")
def server(trace_dir):
    profiler = json.dumps({"profiler": "jax", "profiler_dir": str(trace_dir)})
    app, args, engine = build_server([*ARGV, "--profiler-config", profiler])  # (no other program: the same steps)
    assert engine.engine.async_scheduling  # the server's default (docs/async_scheduling.md)
    # --generation-config auto (the default): the tiny checkpoint's generation_config.json
    assert app.state.default_sampling == {"temperature": 1.0, "top_p": 0.95}
    with live_server(app) as base_url:
        yield base_url, engine
    engine.shutdown()
    assert engine.engine.audit() == []
    pool = engine.engine.pool
    assert pool.num_free == pool.num_usable_blocks, "KV pages leaked"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_completion(client, prompt_ids, n=8):
    r = client.completions.create(model="glm-5.3-tiny", prompt=prompt_ids, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text, r.usage


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["glm-5.3-tiny"]
    # vLLM lists the served name as `id` and what --model named as `root` (here no --model: the preset)
    card = httpx.get(server[0] + "/v1/models").json()["data"][0]
    assert (card["id"], card["root"], card["max_model_len"]) == ("glm-5.3-tiny", "tiny", server[1].max_model_len)
    assert httpx.get(server[0] + "/health").status_code == 200


def test_multi_turn_chat_and_streaming_agree(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    r1 = client.chat.completions.create(model="glm-5.3-tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r1.choices[0].finish_reason in ("stop", "length")
    assert r1.usage.completion_tokens >= 1
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And again, in JSON: {\"a\": 1}"}]
    r2 = client.chat.completions.create(model="glm-5.3-tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
    stream = client.chat.completions.create(model="glm-5.3-tiny", messages=msgs, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, usage, finish, n_chunks = "", None, None, 0
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            n_chunks += 1
    assert text == r2.choices[0].message.content
    assert usage.completion_tokens == r2.usage.completion_tokens and finish == r2.choices[0].finish_reason
    assert n_chunks == 1 + usage.completion_tokens  # the role chunk, then one chunk per engine step


def test_concurrent_greedy_requests_match_one_by_one(client):
    """Equality rule (docs/design.md §10): the batched streams must equal the sequential ones; the API
    exposes no logits, so any divergence fails (the batched and single steps compute each row
    with the same per-row maths)."""
    prompts = [[(7 * i + j) % 400 + 10 for j in range(5 + 9 * i)] for i in range(8)]
    alone = [greedy_completion(client, p)[0] for p in prompts]
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda p: greedy_completion(client, p)[0], prompts))
    assert together == alone


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="glm-5.3-tiny", prompt="Hello", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 99}).choices[0].text
    assert a == b
    assert a != c or len(a) == 0


@pytest.mark.parametrize("body,status", [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ({"model": "glm-5.3-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400),
    ({"model": "glm-5.3-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, 400),
    ({"model": "glm-5.3-tiny", "messages": [{"role": "user", "content": "word " * 1100}]}, 400),
    ({"model": "glm-5.3-tiny", "prompt": [1, 2, 10**7], "max_tokens": 2}, 400),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server[0] + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert greedy_completion(client, [11, 12, 13], 2)[1].completion_tokens == 2


def test_a_token_id_outside_the_vocabulary_is_a_400_naming_the_prompt(server):
    """The engine's refusal (`InvalidRequestError`) names the field, as the server's own checks do."""
    r = httpx.post(server[0] + "/v1/completions", json={"model": "glm-5.3-tiny", "prompt": [5, 511, 512, 7]},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "512" in err["message"] and "vocabulary" in err["message"]
    r = httpx.post(server[0] + "/v1/completions", json={"model": "glm-5.3-tiny", "prompt": [5, 511], "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text


def test_scoring_a_text_with_echo_and_logprobs_follows_one_full_forward(server):
    """What evaluation harnesses send to score a text (lm-evaluation-harness's loglikelihood: `echo`,
    `logprobs: 1`, `max_tokens: 0`): the text back, and each token's logprob given the ones before
    it (the first None) as one full forward of the prompt gives them (`glm53.api.forward`, float64
    log-softmax; to 2e-4), twice — the second time not read from the prefix cache —, through
    vLLM's `prompt_logprobs` with an output, and for a batch of two texts in one request."""
    import numpy as np

    from glm53 import api

    text = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox jumps over the lazy dog."
    body = {"model": "glm-5.3-tiny", "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
            "return_token_ids": True}
    first, again = (httpx.post(server[0] + "/v1/completions", json=body, timeout=120).json() for _ in range(2))
    ids = first["choices"][0]["prompt_token_ids"]
    logits = api.forward(api.load(), ids).astype(np.float64)[:, :server[1].engine.runner.sampling_vocab_size]
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for r in (first, again):
        choice = r["choices"][0]
        assert choice["text"] == text and choice["token_ids"] == []
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) and lps[0] is None
        assert max(abs(lps[i] - ref[i - 1, ids[i]]) for i in range(1, len(ids))) < 2e-4
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = httpx.post(server[0] + "/v1/completions", json={"model": "glm-5.3-tiny", "prompt": ids, "max_tokens": 2,
                                                       "prompt_logprobs": 0, "temperature": 0}, timeout=120).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and [list(e) for e in plp[1:]] == [[str(t)] for t in ids[1:]]
    assert max(abs(plp[i][str(ids[i])]["logprob"] - ref[i - 1, ids[i]]) for i in range(1, len(ids))) < 2e-4
    # A batch, as a harness with a batch size sends it: the texts scored in one request (their
    # prompts in the same steps), each choice against its own prompt's full forward.
    texts = [text, "A second, shorter text to score."]
    r = httpx.post(server[0] + "/v1/completions", json={**body, "prompt": texts}, timeout=120).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["choices"][0]["prompt_token_ids"] == ids
    for choice, t in zip(r["choices"], texts):
        pid = choice["prompt_token_ids"]
        logits = api.forward(api.load(), pid).astype(np.float64)[:, :server[1].engine.runner.sampling_vocab_size]
        ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        lps = choice["logprobs"]["token_logprobs"]
        assert choice["text"] == t and len(lps) == len(pid) and lps[0] is None
        assert max(abs(lps[i] - ref[i - 1, pid[i]]) for i in range(1, len(pid))) < 2e-4
    assert r["usage"]["prompt_tokens"] == sum(len(c["prompt_token_ids"]) for c in r["choices"])


def test_x_data_parallel_rank_is_checked_and_its_refusals_name_the_header(server):
    # One replica: rank 0 is served; 1 and -1 are refused by the engine, the rest by the parser
    # (int() alone took "+1", " 1" and "1_0")
    body = {"model": "glm-5.3-tiny", "prompt": [5, 6], "max_tokens": 2}
    for value, status in (("0", 200), ("1", 400), ("-1", 400), ("+1", 400), ("1_0", 400), ("abc", 400), ("1.0", 400)):
        r = httpx.post(server[0] + "/v1/completions", json=body, headers={"X-data-parallel-rank": value}, timeout=60)
        assert r.status_code == status, (value, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == "X-data-parallel-rank", (value, r.text)


@pytest.mark.parametrize("content", [
    b"{not json",
    b'{"model": "glm-5.3-tiny", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",  # nested too deeply
    b'{"model": "glm-5.3-tiny", "messages": [{"role": "user", "content": "a \\ud800 b"}]}',  # lone surrogate
])
def test_malformed_bodies_are_400(server, client, content):
    r = httpx.post(server[0] + "/v1/chat/completions", content=content, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "error" in r.json()
    r = httpx.post(server[0] + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                   content=b'{"model": "glm-5.3-tiny", "prompt": "a \\udc00 b", "max_tokens": 1}')
    assert r.status_code == 400, r.text


def test_client_disconnect_aborts_and_frees_pages(server, client):
    base, engine = server
    body = {"model": "glm-5.3-tiny", "prompt": "Tell me a long story", "max_tokens": 300, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                break  # got a first token; drop the connection
    deadline = time.time() + 60
    while time.time() < deadline and engine.engine.has_unfinished_requests():
        time.sleep(0.1)
    assert not engine.engine.has_unfinished_requests()
    assert greedy_completion(client, [11, 12, 13], 2)[1].completion_tokens == 2


# ------------------------------------------------ reasoning and tool parsers on the real model

PARSER_FLAGS = ["--reasoning-parser", "glm45", "--tool-call-parser", "glm47", "--enable-auto-tool-choice"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def parsing_server(server):
    """The flags' app (`serving.run.build_api`) with the output parsers, over the same engine."""
    from glm53.tokenizer import GlmTokenizer
    from serving.cli_args import make_arg_parser, validate_args
    from serving.run import build_api

    args = make_arg_parser().parse_args(ARGV + PARSER_FLAGS)
    validate_args(args)
    tokenizer = GlmTokenizer.from_pretrained(server[1].engine.model_path)
    with live_server(build_api(args, server[1], tokenizer)) as base_url:
        yield base_url, tokenizer


@pytest.mark.parametrize("thinking", [True, False])
def test_parsers_split_the_real_model_output(parsing_server, client, thinking):
    """Protocol check with the real model (its text is random): the stream and the message agree,
    and both equal the split of the raw completion of the same prompt at the first </think>."""
    base_url, tokenizer = parsing_server
    pclient = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="glm-5.3-tiny", messages=messages, tools=TOOLS, max_tokens=16, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": thinking}, "ignore_eos": True})
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, enable_thinking=thinking)
    raw = greedy_completion(client, tokenizer.encode(prompt), 16)[0]
    assert "<tool_call>" not in raw, "precondition: the random model wrote no tool markup"
    head, sep, tail = raw.partition("</think>")
    reasoning, content = (head.strip(), tail.strip()) if thinking and sep else (
        (raw.strip(), "") if thinking else ("", raw.strip()))

    msg = pclient.chat.completions.create(**kw).choices[0]
    assert (msg.message.reasoning_content or "", msg.message.content or "") == (reasoning, content)
    assert msg.finish_reason == "length" and not msg.message.tool_calls

    streamed = {"reasoning_content": "", "content": ""}
    finish = None
    for chunk in pclient.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed["content"] += c.delta.content or ""
            streamed["reasoning_content"] += getattr(c.delta, "reasoning_content", None) or ""
            assert not c.delta.tool_calls
            finish = c.finish_reason or finish
    assert (streamed["reasoning_content"], streamed["content"], finish) == (reasoning, content, "length")


def test_tool_requests_refused_or_forced_on_the_real_server(server, parsing_server):
    body = {"model": "glm-5.3-tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)  # no parser flags
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    pclient = openai.OpenAI(base_url=parsing_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="not among"):
        pclient.chat.completions.create(model="glm-5.3-tiny", messages=body["messages"], tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "now"}}, max_tokens=2)
    r = pclient.chat.completions.create(model="glm-5.3-tiny", messages=body["messages"], tools=TOOLS, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    # A named tool choice is a constraint (structured outputs): the random model calls the tool.
    now = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    r = pclient.chat.completions.create(model="glm-5.3-tiny", messages=body["messages"], tools=[*TOOLS, now],
                                        tool_choice={"type": "function", "function": {"name": "now"}}, max_tokens=16,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["now"]
    assert c.message.tool_calls[0].function.arguments == "{}"


def test_anthropic_messages_on_the_real_engine(server, parsing_server):
    """`/v1/messages` (serving/api/anthropic.py) over the real engine: a greedy answer's tokens are
    the chat route's for the same conversation (thinking off, so all of it is text); a named tool
    (structured outputs) comes back as a `tool_use` block, streamed and not; a client that drops
    the stream gets its request aborted."""
    import anthropic

    engine = server[1]
    claude = anthropic.Anthropic(base_url=parsing_server[0], api_key="unused", max_retries=0, timeout=120)
    pclient = openai.OpenAI(base_url=parsing_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Name three colours."}]
    greedy = {"temperature": 0}  # a request field the current SDK no longer names: sent as extra body
    msg = claude.messages.create(model="glm-5.3-tiny", max_tokens=12, messages=msgs, extra_body=greedy,
                                 thinking={"type": "disabled"})
    chat = pclient.chat.completions.create(model="glm-5.3-tiny", max_tokens=12, temperature=0, messages=msgs,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    now = {"name": "now", "input_schema": {"type": "object", "properties": {}}}
    kw = dict(model="glm-5.3-tiny", max_tokens=16, messages=msgs, tools=[now], extra_body=greedy,
              tool_choice={"type": "tool", "name": "now"}, thinking={"type": "disabled"})
    called = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for m in (called, streamed):
        assert m.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "now", {})]
    # usage's prefix-cache split, streamed as not: a repeated prompt is read from the cache
    long = dict(model="glm-5.3-tiny", max_tokens=2, extra_body=greedy, thinking={"type": "disabled"},
                messages=[{"role": "user", "content": "Remember: " + "the sea and the hills " * 24}])
    claude.messages.create(**long)  # fills the cache
    again = claude.messages.create(**long)
    with claude.messages.stream(**long) as stream:
        streamed_usage = stream.get_final_message().usage
    assert again.usage.cache_read_input_tokens > 0
    assert (streamed_usage.input_tokens, streamed_usage.cache_read_input_tokens) == (
        again.usage.input_tokens, again.usage.cache_read_input_tokens)
    # output_config.format: the random model's answer is constrained to the schema
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = claude.messages.create(model="glm-5.3-tiny", max_tokens=64, messages=msgs, extra_body=greedy,
                                    thinking={"type": "disabled"},
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    assert isinstance(json.loads(shaped.content[0].text)["ok"], bool) and shaped.stop_reason == "end_turn"
    with httpx.stream("POST", parsing_server[0] + "/v1/messages", timeout=60, json={
            "model": "glm-5.3-tiny", "max_tokens": 300, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "content_block_delta":
                running = engine.engine.has_unfinished_requests()
                break  # a first token; drop the connection
    assert running, "precondition: the answer was still being generated"
    deadline = time.time() + 60
    while time.time() < deadline and engine.engine.has_unfinished_requests():
        time.sleep(0.1)
    assert not engine.engine.has_unfinished_requests()


def test_a_thinking_budget_closes_the_think_block_on_the_real_engine(parsing_server):
    """`thinking_token_budget` (vLLM's field; Anthropic's `thinking.budget_tokens`): the random
    model never closes its think block by itself (its unbudgeted answer is all reasoning), so
    with a budget of B the reasoning is the first B tokens of that answer and `</think>` follows:
    `reasoning_tokens` is B, and there is content after it. Render and background responses get
    the engine's 400s before anything runs."""
    base, tokenizer = parsing_server
    pclient = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="glm-5.3-tiny", temperature=0, max_tokens=12, messages=[{"role": "user", "content": "Think."}])
    prompt = httpx.post(base + "/v1/chat/completions/render", json=kw, timeout=60).json()["token_ids"]
    end, budget = tokenizer.encode("</think>"), 5

    def completion(**extra):  # the chat's prompt as token ids: the block is open (the prompt ends with <think>)
        return pclient.completions.create(model="glm-5.3-tiny", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True, **extra})

    free = completion().choices[0].model_extra["token_ids"]
    ids = completion(thinking_token_budget=budget).choices[0].model_extra["token_ids"]
    assert end[0] not in free and ids[:budget] == free[:budget] and ids[budget:budget + 1] == end, (free, ids)
    prompt = prompt + tokenizer.encode("\n")  # whitespace after the <think> still leaves the block open
    ids = completion(thinking_token_budget=2).choices[0].model_extra["token_ids"]
    assert ids[2:3] == end, ids
    chat_free = pclient.chat.completions.create(**kw)
    assert not chat_free.choices[0].message.content and chat_free.usage.completion_tokens_details.reasoning_tokens == 12
    cut = pclient.chat.completions.create(**kw, extra_body={"thinking_token_budget": budget})
    assert cut.usage.completion_tokens_details.reasoning_tokens == budget and cut.choices[0].message.content
    assert cut.choices[0].message.reasoning_content.strip() == tokenizer.decode(free[:budget]).strip()
    # Anthropic's budget_tokens is the same budget
    import anthropic

    with anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120) as claude:
        msg = claude.messages.create(model="glm-5.3-tiny", max_tokens=12, extra_body={"temperature": 0},
                                     thinking={"type": "enabled", "budget_tokens": budget},
                                     messages=[{"role": "user", "content": "Think."}])
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == cut.choices[0].message.reasoning_content
    # the engine's own checks, before anything runs
    for path, body, param in [
            ("/v1/completions/render", {"model": "glm-5.3-tiny", "prompt": [10 ** 9]}, "prompt"),
            ("/v1/chat/completions/render", {**kw, "logit_bias": {"100000": 1}}, "logit_bias"),
            ("/v1/chat/completions/render", {**kw, "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
            ("/v1/responses", {"model": "glm-5.3-tiny", "input": "x", "background": True, "text": {"format": {
                "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
             None)]:
        r = httpx.post(base + path, json={k: v for k, v in body.items() if k != "extra_body"}, timeout=60)
        assert r.status_code == 400 and (param is None or r.json()["error"]["param"] == param), (path, r.text)


def test_responses_api_on_the_real_engine(parsing_server):
    """`/v1/responses` (serving/api/responses.py) over the real engine: a greedy answer's tokens are
    the chat route's (reasoning off); a named function comes back as a `function_call` item,
    streamed and not; a `json_schema` text format constrains the answer."""
    pclient = openai.OpenAI(base_url=parsing_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    base = {"model": "glm-5.3-tiny", "temperature": 0, "reasoning": {"effort": "none"}}
    r = pclient.responses.create(input="Name three colours.", max_output_tokens=12, **base)
    chat = pclient.chat.completions.create(model="glm-5.3-tiny", max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "Name three colours."}],
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.output_text == chat.choices[0].message.content and r.usage.output_tokens == chat.usage.completion_tokens
    # a stored conversation goes on from its id: the tokens of the whole conversation sent to chat
    r2 = pclient.responses.create(input="Three more?", previous_response_id=r.id, max_output_tokens=12, **base)
    chat2 = pclient.chat.completions.create(
        model="glm-5.3-tiny", max_tokens=12, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        messages=[{"role": "user", "content": "Name three colours."},
                  {"role": "assistant", "content": chat.choices[0].message.content},
                  {"role": "user", "content": "Three more?"}])
    assert r2.output_text == chat2.choices[0].message.content and r2.usage.input_tokens == chat2.usage.prompt_tokens
    # in the background: polled to the same answer
    bg = pclient.responses.create(input="Name three colours.", max_output_tokens=12, background=True, **base)
    deadline = time.monotonic() + 60
    while (polled := pclient.responses.retrieve(bg.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled.status == r.status and polled.output_text == r.output_text
    now = {"type": "function", "name": "now", "parameters": {"type": "object", "properties": {}}}
    kw = dict(input="What time is it?", max_output_tokens=16, tools=[now], tool_choice={"type": "function", "name": "now"},
              **base)
    called = pclient.responses.create(**kw)
    with pclient.responses.stream(**kw) as stream:
        streamed = stream.get_final_response()
    for resp in (called, streamed):
        assert [(i.type, i.name, i.arguments) for i in resp.output if i.type != "message"] == [("function_call", "now", "{}")]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = pclient.responses.create(input="Is it ok?", max_output_tokens=64, **base,
                                      text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    assert isinstance(json.loads(shaped.output_text)["ok"], bool) and shaped.status == "completed"


def _engine_steps_in(run_dir) -> list[int]:
    """The step numbers of the `engine_step` annotations in a run's Perfetto trace."""
    import gzip
    from pathlib import Path

    (trace,) = Path(run_dir).glob("perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sorted({int(e["args"]["step_num"]) for e in events
                   if e.get("name") == "engine_step" and e.get("ph") == "X"})


def test_a_profile_holds_the_engine_steps_between_start_and_stop(server, client, trace_dir):
    """`--profiler-config` (serving/profiling.py): POST /start_profile, requests, /stop_profile →
    a jax.profiler run directory with the XSpace and Perfetto files, whose `engine_step`
    annotations are whole consecutive steps (at least one per generated token); a second start
    or a stop without a trace is a 400; `max_steps` ends a trace by itself."""
    from serving.profiling import EngineProfiler, ProfilerConfig

    base, engine = server
    assert httpx.post(base + "/stop_profile").status_code == 400
    started = httpx.post(base + "/start_profile")
    assert started.status_code == 200 and started.json()["profiler_dir"] == str(trace_dir)
    again = httpx.post(base + "/start_profile")
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    greedy_completion(client, [5, 6, 7, 8], n=6)
    stopped = httpx.post(base + "/stop_profile", timeout=120).json()
    run = stopped["trace_dir"]
    assert run.startswith(str(trace_dir)) and any(f.endswith(".xplane.pb") for f in os.listdir(run))
    steps = _engine_steps_in(run)
    assert len(steps) >= 6 and steps == list(range(steps[0], steps[0] + len(steps)))
    from scripts.trace_summary import summarize  # the run's summary script agrees

    summary = summarize(run, top=5)
    assert summary["steps"]["count"] == len(steps) and summary["steps"]["max_ms"] >= summary["steps"]["p50_ms"] > 0
    (host,) = [rows for proc, rows in summary["by_process"].items() if proc.startswith("/host")]
    assert len(host) == 5 and host[0]["total_ms"] >= host[-1]["total_ms"] > 0
    # bounded: max_steps ends the trace after that many engine steps
    bounded = trace_dir / "bounded"
    saved, engine.profiler = engine.profiler, EngineProfiler(ProfilerConfig(str(bounded), max_steps=3))
    try:
        assert httpx.post(base + "/start_profile").status_code == 200
        greedy_completion(client, [9, 10, 11], n=8)
        assert not engine.profiler.active and len(_engine_steps_in(engine.profiler.last_run)) == 3
        assert str(bounded) in engine.profiler.last_run
        assert httpx.post(base + "/stop_profile").status_code == 400  # it has stopped already
        # a directory that cannot be written (a file took its place) is a 400 saying so, not a 500
        blocked = trace_dir / "blocked"
        blocked.write_text("")
        engine.profiler = EngineProfiler(ProfilerConfig(str(blocked)))
        r = httpx.post(base + "/start_profile")
        assert r.status_code == 400 and "cannot write traces" in r.json()["error"]["message"], r.text
    finally:
        engine.profiler = saved


def _metrics(base):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_cached_tokens_in_usage_and_metrics(server, client):
    base, _ = server
    prompt = [(13 * i) % 430 + 10 for i in range(800)]
    lab = (("model_name", "glm-5.3-tiny"),)
    before = _metrics(base)
    kw = dict(model="glm-5.3-tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    cold = client.completions.create(**kw)
    warm = client.completions.create(**kw)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == 768
    assert warm.choices[0].text == cold.choices[0].text
    assert warm.choices[0].logprobs.tokens == cold.choices[0].logprobs.tokens
    after = _metrics(base)
    assert after[("vllm:prefix_cache_hits_total", lab)] - before.get(("vllm:prefix_cache_hits_total", lab), 0) == 768
    assert after[("vllm:prompt_tokens_total", lab)] - before.get(("vllm:prompt_tokens_total", lab), 0) == 1600
    assert after[("vllm:generation_tokens_total", lab)] - before.get(("vllm:generation_tokens_total", lab), 0) == 6
    assert ("vllm:num_preemptions_total", lab) in after and ("vllm:kv_cache_usage_perc", lab) in after


def test_chat_logprobs_n_and_stop_on_the_real_engine(server, client):
    msgs = [{"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(model="glm-5.3-tiny", messages=msgs, max_completion_tokens=6, temperature=0,
                                       n=2, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    a, b = r.choices
    assert a.message.content == b.message.content and r.usage.completion_tokens == 12
    assert len(a.logprobs.content) == 6
    for e in a.logprobs.content:  # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    text = a.message.content
    stop = next(c for c in text[1:] if c != "\ufffd")
    base = server[0]
    before = _metrics(base)
    kw = dict(model="glm-5.3-tiny", messages=msgs, max_completion_tokens=12, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    s = client.chat.completions.create(**kw)
    assert s.choices[0].message.content == text[: text.index(stop)] and s.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Both engine requests were aborted at the stop string: counted as "stop", not "abort".

    def success_delta():
        after = _metrics(base)
        keys = {r: ("vllm:request_success_total", (("finished_reason", r), ("model_name", "glm-5.3-tiny")))
                for r in ("stop", "abort", "length")}
        return {r: after.get(k, 0) - before.get(k, 0) for r, k in keys.items()}

    deadline = time.monotonic() + 30  # the abort reaches the engine thread after the reply is sent
    while success_delta()["stop"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert success_delta() == {"stop": 2, "abort": 0, "length": 0}


def test_return_token_ids_gives_prompt_and_output_ids(server, client):
    """vLLM's `return_token_ids` extension: the ids a multi-turn client feeds back as the next
    prompt (scripts/bench_agentic.py), streaming and not; absent unless asked for."""
    prompt = [(11 * i) % 430 + 10 for i in range(40)]
    kw = dict(model="glm-5.3-tiny", prompt=prompt, max_tokens=5, temperature=0)
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.model_dump()["choices"][0]
    assert c["prompt_token_ids"] == prompt and len(c["token_ids"]) == 5
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).model_dump()["choices"][0]
    assert "token_ids" not in plain and plain["text"] == c["text"]
    chunks = [ch.model_dump()["choices"] for ch in client.completions.create(
        **kw, stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})]
    ids = [t for chs in chunks for ch in chs for t in ch.get("token_ids") or []]
    assert ids == c["token_ids"]
    assert chunks[0][0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in ch for chs in chunks[1:] for ch in chs)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_never_hit_the_padding_ids(client, stream):
    """The tiny checkpoint pads its vocabulary (512 embedding rows, 496 tokenizer ids): asking for
    the 20 most likely tokens used to put padding ids among them, and turning those into text
    failed the request (500, or an error event ending the stream). Now the padding ids are never
    sampled nor reported (`serving.sampling.mask_unreachable`), so every reported token has text
    and bytes. Sampling at temperature 1.5 with
    several seeds also exercises the sampled (not just greedy) path."""
    msgs = [{"role": "user", "content": "List some words."}]
    for seed in range(3):
        kw = dict(model="glm-5.3-tiny", messages=msgs, max_tokens=12, temperature=1.5, seed=seed, logprobs=True,
                  top_logprobs=20, extra_body={"ignore_eos": True})
        if stream:
            text, entries = "", []
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    entries += c.logprobs.content if c.logprobs and c.logprobs.content else []
        else:
            r = client.chat.completions.create(**kw)
            text, entries = r.choices[0].message.content, r.choices[0].logprobs.content
        assert len(entries) == 12
        for e in entries:
            assert len(e.top_logprobs) == 20
            assert all(t.token != "" and t.bytes for t in e.top_logprobs), "a padding id was reported"
            assert e.token != "" and e.bytes
        assert text is not None


def test_a_failed_engine_step_answers_500_and_the_server_keeps_serving(server, client):
    """The runner's fault-injection hook (`serving.faults.FaultInjection`) makes the next step
    raise: that request gets an OpenAI 500 body (non-streaming, or streaming before the first
    token) or a final error event (streaming, after its first tokens), its pages are freed, `/health` stays 200, and the next request gets the same
    tokens as before the fault."""
    from serving.faults import FaultInjection

    base, engine = server
    runner = engine.engine.runner
    prompt = [21, 22, 23, 24, 25, 26, 27]
    before = greedy_completion(client, prompt, 6)[0]
    runner.faults = FaultInjection("step_error")
    try:
        with pytest.raises(openai.InternalServerError) as ei:
            greedy_completion(client, [31, 32, 33], 6)
        body = ei.value.response.json()
        assert body["error"]["code"] == 500 and "engine step failed" in body["error"]["message"]
        runner.faults = FaultInjection("step_error", at_step=3)  # after the stream's first tokens
        stream = client.completions.create(model="glm-5.3-tiny", prompt=[41, 42, 43], max_tokens=6, temperature=0,
                                           stream=True)
        got = []
        with pytest.raises(openai.APIError, match="engine step failed"):
            for chunk in stream:
                got.append(chunk)
        assert len(got) == 2  # the tokens of steps 1 and 2, then the error event
    finally:
        runner.faults = None
    assert httpx.get(base + "/health").status_code == 200
    assert greedy_completion(client, prompt, 6)[0] == before
    assert engine.engine.audit() == []
    assert not engine.engine.has_unfinished_requests()


def test_a_shut_down_server_leaves_nothing_holding_its_engine():
    """After a server has answered and been shut down, nothing keeps its engine (weights and KV
    arena) alive. FastAPI keeps route callables in process-wide caches, so a route that closed
    over the engine pinned it, with its device memory, for the rest of the process (every server
    a notebook or the test suite started)."""

    def serve_once():
        app, _, engine = build_server(ARGV)
        with live_server(app) as base:
            r = httpx.post(base + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=120)
            assert r.status_code == 200, r.text
            for path in ("/health", "/v1/models", "/v1/models/glm-5.3-tiny", "/metrics"):
                assert httpx.get(base + path, timeout=30).status_code == 200, path
        engine.shutdown()
        return [weakref.ref(engine), weakref.ref(engine.engine)]

    refs = serve_once()
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_checkpoint_without_a_usable_tokenizer_stops_start_up_before_loading(tmp_path, monkeypatch):
    """The server needs the tokenizer: a checkpoint without one, or with a broken one, is refused
    before the weights load and the steps compile (minutes for GLM-5.3)."""
    import shutil

    import serving.engine_factory
    from glm53.tiny_checkpoint import default_model_dir

    def no_load(*a, **k):
        raise AssertionError("the engine was built before the tokenizer was checked")

    monkeypatch.setattr(serving.engine_factory, "build_engine", no_load)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(default_model_dir(), ckpt)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(SystemExit, match=r"no tokenizer\.json at .*ckpt/tokenizer\.json \(the server needs"):
        build_server(["--model", str(ckpt)])
    (ckpt / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(SystemExit, match=r"tokenizer\.json is not a tokenizer the HF tokenizers library can read"):
        build_server(["--model", str(ckpt)])
