"""The OpenAI-compatible HTTP layer against a deterministic fake engine, driven by real clients
(the `openai` package and raw httpx) over a live uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from serving.api import build_app
from serving.detokenize import IncrementalDetokenizer
from serving.types import RequestOutput, SamplingParams, TokenLogprobs
from tests.helpers.live_server import live_server

API_KEY = "test-secret-key"
MODEL = "glm-test"
MAX_MODEL_LEN = 256
# The fake engine's answer: multi-byte characters split across byte-level tokens.
REPLY = "Hello there! 你好世界 🙂 — the quick fox."


def fake_logprobs(token: int) -> TokenLogprobs:
    """The fake engine's logprobs of a token: itself at -0.25, then token+1.. at -1, -2, ..."""
    return TokenLogprobs(token, -0.25, [(token, -0.25)] + [(token + k, -float(k)) for k in range(1, 20)])


def fake_prompt_logprobs(prompt: list[int], k: int) -> list[TokenLogprobs | None]:
    """The fake engine's prompt logprobs: prompt token i at -i / 10 with rank i + 1 (above it the
    ids 1000, 1001, ... at -0.01, -0.02, ...), k of those alternatives."""
    return [None] + [TokenLogprobs(t, -i / 10, [(1000 + j, -(j + 1) / 100) for j in range(k)], i + 1)
                     for i, t in enumerate(prompt[1:], 1)]


class FakeEngine:
    """A deterministic `EngineClient`: answers REPLY then EOS, one or two tokens per increment.

    Prompt markers change its behaviour: RAISE_VALUE (ValueError), RAISE_BOOM (RuntimeError
    before the first token), BOOM_LATER (RuntimeError after a few tokens), SLOW (50 ms per
    token), STALL (30 s before each token), QUEUED STALL (the same but for the first choice: the
    others wait, as choices beyond --max-num-seqs do). `ignore_eos` cycles REPLY+EOS until max_tokens.
    Aborts and cancelled generators are recorded (thread-safe) so tests can wait for them.
    """

    model_name = "tiny-fake-checkpoint"

    def __init__(self, tokenizer) -> None:
        self.max_model_len = MAX_MODEL_LEN
        self.max_logprobs = 20
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.reply_ids = tokenizer.encode(REPLY)
        self.healthy = True
        self.lock = threading.Lock()
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.submitted: dict[str, tuple[list[int], SamplingParams]] = {}
        self.changed = threading.Condition(self.lock)

    def is_healthy(self) -> bool:
        return self.healthy

    async def abort(self, request_id: str, finished_reason: str = "abort") -> None:
        with self.changed:
            self.aborted.append(request_id)
            self.changed.notify_all()

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    async def generate(self, prompt_token_ids, params: SamplingParams, request_id: str):
        params.validate()
        with self.changed:
            self.submitted[request_id] = (list(prompt_token_ids), params)
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")
        prompt = self.tokenizer.decode(prompt_token_ids)
        if "RAISE_VALUE" in prompt:
            raise ValueError("the fake engine refuses this prompt")
        if "RAISE_BOOM" in prompt:
            raise RuntimeError("the fake engine broke")
        delay = 0.05 if "SLOW" in prompt else 0.0
        if "STALL" in prompt and ("QUEUED" not in prompt or not request_id.endswith("-0")):
            delay = 30.0  # a long "prefill" (QUEUED: every choice but the first): only a disconnect ends it
        seq = self.reply_ids + [self.eos]
        n_out, step, finished = 0, 0, False
        try:
            while not finished:
                await asyncio.sleep(delay)
                if "BOOM_LATER" in prompt and n_out >= 3:
                    raise RuntimeError("the fake engine broke mid-stream")
                new = []
                for _ in range(1 + step % 2):
                    tok = seq[n_out % len(seq)]
                    new.append(tok)
                    n_out += 1
                    if (tok == self.eos and not params.ignore_eos) or tok in (params.stop_token_ids or ()):
                        finished, reason = True, "stop"
                        break
                    if n_out >= params.max_tokens:
                        finished, reason = True, "length"
                        break
                step += 1
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=new,
                    finished=finished,
                    finish_reason=reason if finished else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=0,
                    num_output_tokens=n_out,
                    new_logprobs=None if params.logprobs is None else [fake_logprobs(t) for t in new],
                    prompt_logprobs=None if params.prompt_logprobs is None or step > 1
                    else fake_prompt_logprobs(list(prompt_token_ids), params.prompt_logprobs),
                )
        finally:
            if not finished:
                with self.changed:
                    self.cancelled.append(request_id)
                    self.changed.notify_all()


@pytest.fixture(scope="module")
def engine(tiny_tokenizer) -> FakeEngine:
    return FakeEngine(tiny_tokenizer)


@pytest.fixture(scope="module")
def base_url(engine, tiny_tokenizer):
    app = build_app(engine, tiny_tokenizer, MODEL, api_key=API_KEY)
    with live_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture
def http(base_url):
    with httpx.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
    ) as c:
        yield c


def _expected(tokenizer, n: int | None = None) -> str:
    ids = tokenizer.encode(REPLY) + [tokenizer.eos_token_id]
    return tokenizer.decode(ids if n is None else ids[:n])


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# ---------------------------------------------------------------------------------------- happy


def test_chat_non_stream(client, tiny_tokenizer):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
            },
        ],
        temperature=0,
        seed=1,
        reasoning_effort="high",
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert r.created > 0
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _expected(tiny_tokenizer)
    assert r.choices[0].finish_reason == "stop"
    n_reply = len(tiny_tokenizer.encode(REPLY)) + 1
    assert r.usage.completion_tokens == n_reply
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_reply
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_template_and_sampling_params_reach_engine(client, engine, tiny_tokenizer):
    r = client.chat.completions.create(
        model=MODEL,
        messages=_user("Hi"),
        max_completion_tokens=3,
        temperature=0.7,
        top_p=0.9,
        seed=42,
        reasoning_effort="low",
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"7": 250, "9": -3.5},
        extra_body={"ignore_eos": True, "stop_token_ids": [7], "top_k": 20, "min_p": 0.05, "min_tokens": 2,
                    "repetition_penalty": 1.2},
    )
    prompt_ids, params = engine.submitted[r.id]
    # the penalties as given; a bias past OpenAI's range clamped to it (vLLM's handling)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.2)
    assert params.logit_bias == {7: 100.0, 9: -3.5}
    assert tiny_tokenizer.decode(prompt_ids, skip_special_tokens=False) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Low<|user|>Hi<|assistant|><think>"
    )
    assert (params.temperature, params.top_p, params.seed, params.max_tokens) == (0.7, 0.9, 42, 3)
    assert (params.top_k, params.min_p, params.min_tokens) == (20, 0.05, 2)
    assert params.ignore_eos and params.stop_token_ids == [7]
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_chat_default_max_tokens_fills_context(client, engine):
    r = client.chat.completions.create(
        model=MODEL, messages=_user("Hi"), extra_body={"ignore_eos": True}
    )
    prompt_ids, params = engine.submitted[r.id]
    assert params.max_tokens == MAX_MODEL_LEN - len(prompt_ids)
    assert r.usage.completion_tokens == params.max_tokens
    assert r.choices[0].finish_reason == "length"


def test_a_stop_token_is_in_the_token_ids_but_not_the_text(http, tiny_tokenizer):
    """The fake engine ends REPLY with EOS (finish_reason "stop"): as in vLLM, the EOS token stays
    in the token ids but its text does not reach the output, even with skip_special_tokens false
    (it used to end the text with "<|endoftext|>")."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 100,
                                           "skip_special_tokens": False, "return_token_ids": True}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == tiny_tokenizer.eos_token_id
    assert choice["text"] == REPLY and choice["stop_reason"] is None  # EOS: no stop_reason (vLLM)
    # streamed the same, and no stream chunk carries a null kv_transfer_params
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 100,
                                                       "skip_special_tokens": False, "stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == REPLY
    assert not any("kv_transfer_params" in c for c in chunks)


def test_a_stream_starts_before_every_choice_has_output(http, engine):
    """With `n` above --max-num-seqs some choices wait for others to finish: the stream (its
    headers and the first choice's chunks) must not wait for them (it did: 8.6 s to the first
    byte at n = 33 on the tiny model's server)."""
    body = {"model": MODEL, "prompt": "QUEUED STALL", "n": 2, "stream": True, "max_tokens": 5}
    t0 = time.monotonic()
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
    assert first["choices"][0]["index"] == 0 and time.monotonic() - t0 < 5
    assert engine.wait_for(lambda: any(c.endswith("-1") for c in engine.cancelled))  # closing it cancels the rest


def test_completions_take_max_completion_tokens(client, engine):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=9,
                                  extra_body={"max_completion_tokens": 4, "ignore_eos": True})
    assert engine.submitted[r.id][1].max_tokens == 4 and r.usage.completion_tokens == 4


def test_add_generation_prompt_and_continue_final_message(client, engine, tiny_tokenizer):
    """vLLM's chat fields: without the generation prompt the template's assistant opener is left
    out; `continue_final_message` continues the last assistant message where its text ends (the
    template's end of turn after it dropped)."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]

    def rendered(**extra):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, extra_body=extra)
        return tiny_tokenizer.decode(engine.submitted[r.id][0], skip_special_tokens=False)

    full = rendered()
    assert full.endswith("<|assistant|><think>")  # the opener of a new assistant turn
    closed = rendered(add_generation_prompt=False)
    assert full.startswith(closed) and not closed.endswith("<|assistant|><think>")
    cont = rendered(add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("Once upon") and closed.startswith(cont)  # (this template closes no turn)
    from serving.api.validation import continue_final_message  # a template that does close it
    assert continue_final_message("<|assistant|> Once upon<|end|>\n", " Once upon ") == "<|assistant|> Once upon"


def test_chat_echo_opens_the_answer_with_the_continued_assistant_message(client, tiny_tokenizer):
    """vLLM's chat `echo`: when the last message is the assistant's and the answer continues it
    (add_generation_prompt false), that message's content opens every choice's content, streamed
    as each choice's first content; with the usual last user message nothing is echoed."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 4, "n": 2,
          "extra_body": {"echo": True, "add_generation_prompt": False, "continue_final_message": True}}
    r = client.chat.completions.create(**kw)
    assert [c.message.content for c in r.choices] == ["Once upon" + _expected(tiny_tokenizer, 4)] * 2
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for i in range(2):
        parts = [c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(parts) == "Once upon" + _expected(tiny_tokenizer, 4)
        assert next(p for p in parts if p) == "Once upon"
    r = client.chat.completions.create(model=MODEL, messages=_user("Hi"), max_tokens=4, extra_body={"echo": True})
    assert r.choices[0].message.content == _expected(tiny_tokenizer, 4)


def test_chat_stream_with_usage(client, tiny_tokenizer):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_user("Hello"),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    deltas = [c.choices[0].delta.content or "" for c in content_chunks]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == _expected(tiny_tokenizer)
    assert len([d for d in deltas if d]) > 3  # really incremental
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == len(tiny_tokenizer.encode(REPLY)) + 1
    assert usage_chunk.usage.total_tokens == (
        usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    )
    assert all(c.usage is None for c in chunks[:-1])


def _increments(n_tokens: int) -> int:
    """How many outputs FakeEngine yields for n_tokens tokens (1, 2, 1, 2, ... tokens each)."""
    n = steps = 0
    while n < n_tokens:
        n += 1 + steps % 2
        steps += 1
    return steps


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_one_chunk_per_engine_step(http, tiny_tokenizer, endpoint):
    # REPLY's CJK and emoji characters are split over byte tokens, so several engine outputs add
    # no visible text; each still gets its own (empty) chunk, as vLLM streams, so that a client
    # counting chunks (evalscope's decoded tokens per iteration) sees one step per chunk.
    n_tokens = len(tiny_tokenizer.encode(REPLY)) + 1
    body = {"model": MODEL, "stream": True, "max_tokens": 200}
    if endpoint == "chat":
        body["messages"] = _user("Hello")
    else:
        body["prompt"] = "Hello"
    with http.stream("POST", f"/v1/{'chat/' if endpoint == 'chat' else ''}completions", json=body) as resp:
        raw = resp.read().decode()
    payloads = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n")[:-2]]
    if endpoint == "chat":
        assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        payloads = payloads[1:]
        texts = [p["choices"][0]["delta"].get("content") or "" for p in payloads]
    else:
        texts = [p["choices"][0]["text"] for p in payloads]
    assert len(payloads) == _increments(n_tokens)
    assert "".join(texts) == _expected(tiny_tokenizer)
    assert "" in texts[:-1]  # an output that completed no character still had its chunk


def test_chat_stream_raw_sse_format(http, tiny_tokenizer):
    body = {"model": MODEL, "messages": _user("Hello"), "stream": True, "max_tokens": 4}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in payloads)  # no include_usage
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
    assert text == _expected(tiny_tokenizer, 4)


def test_completions_string_prompt(client, tiny_tokenizer):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == _expected(tiny_tokenizer, 5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tiny_tokenizer.encode("Hello there"))
    assert r.usage.completion_tokens == 5


def test_completions_token_prompt_and_default_max_tokens(client, engine, tiny_tokenizer):
    r = client.completions.create(model=MODEL, prompt=[10, 11, 12])
    prompt_ids, params = engine.submitted[r.id]
    assert prompt_ids == [10, 11, 12] and params.max_tokens == 16
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text == _expected(tiny_tokenizer, 16)
    # A one-element batch is accepted too.
    r2 = client.completions.create(model=MODEL, prompt=[[10, 11, 12]], max_tokens=2)
    assert engine.submitted[r2.id][0] == [10, 11, 12]


def test_completions_stream(client, tiny_tokenizer):
    stream = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == _expected(tiny_tokenizer)
    assert text_chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_prompt_logprobs_in_vllms_shape(http, engine, tiny_tokenizer):
    """`prompt_logprobs: k` (vLLM's extension): each choice carries, per prompt token, None for
    the first, then {token id: {logprob, rank, decoded_token}} for the prompt token and its k
    alternatives; the engine is asked for them, and the output is unchanged."""
    prompt = [10, 11, 12, 13]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert engine.submitted[r.json()["id"]][1].prompt_logprobs == 2
    assert choice["text"] == _expected(tiny_tokenizer, 3) and choice["logprobs"] is None
    plp = choice["prompt_logprobs"]
    assert len(plp) == 4 and plp[0] is None
    for i, entry in enumerate(plp[1:], 1):
        tok = str(prompt[i])
        assert entry[tok] == {"logprob": -i / 10, "rank": i + 1, "decoded_token": tiny_tokenizer.decode([prompt[i]])}
        assert entry["1000"]["rank"] == 1 and entry["1001"]["logprob"] == -0.02 and len(entry) == 3
    # left out of the body when not asked for
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert "prompt_logprobs" not in r.json()["choices"][0]


def test_completions_echo_and_scoring_a_prompt(http, client, engine, tiny_tokenizer):
    """`echo`: the prompt's text before the output; with `logprobs` the prompt's tokens lead the
    logprobs (the first with None, as vLLM and OpenAI give them); `max_tokens: 0` with echo is the
    prompt alone (the engine generates one token, left out) — how evaluation harnesses score a text."""
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, echo=True)
    assert r.choices[0].text == "Hello there" + _expected(tiny_tokenizer, 3)
    assert engine.submitted[r.id][1].prompt_logprobs is None  # no logprobs: nothing to compute
    ids = tiny_tokenizer.encode("Hello there")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 0, "echo": True,
                                           "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    sent = engine.submitted[body["id"]][1]
    assert sent.max_tokens == 1 and sent.prompt_logprobs == 1 and sent.logprobs == 1
    choice = body["choices"][0]
    assert choice["text"] == "Hello there" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    texts = [tiny_tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["tokens"] == texts and lp["token_logprobs"] == [None] + [-i / 10 for i in range(1, len(ids))]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {texts[1]: -0.1, tiny_tokenizer.decode([1000]): -0.01}
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(ids))]
    # echo with output logprobs, streaming: the first chunk opens with the prompt and its entries
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, echo=True, logprobs=1,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith("Hello there")
    assert "".join(c.choices[0].text for c in chunks) == "Hello there" + _expected(tiny_tokenizer, 4)
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed[:len(ids)] == texts and len(streamed) == len(ids) + 4
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_completions_batched_prompts(http, client, engine, tiny_tokenizer):
    """A batch of prompts (strings or token-id lists): each prompt is served as its own `n`
    choices, choice p·n + j being prompt p's j-th (OpenAI's order), each with its own prompt's
    max_tokens default, echo and token ids; usage counts every prompt once. Streamed, every
    choice's chunks carry its index and add up to the non-streamed text. Scoring a batch (echo,
    logprobs, max_tokens 0 — what evaluation harnesses send with a batch size) gives each prompt's
    own prompt logprobs."""
    prompts = ["Hello there", "The quick brown fox"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, n=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [p + _expected(tiny_tokenizer, 3) for p in prompts for _ in range(2)]
    ids = [tiny_tokenizer.encode(p) for p in prompts]
    assert [engine.submitted[f"{r.id}-{i}"][0] for i in range(4)] == [ids[0], ids[0], ids[1], ids[1]]
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and r.usage.completion_tokens == 4 * 3
    # Token-id prompts; max_tokens null is each prompt's own room below --max-model-len.
    long = [7] * (MAX_MODEL_LEN - 10)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [[10, 11, 12], long], "max_tokens": None,
                                           "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [engine.submitted[f"{body['id']}-{i}"][1].max_tokens for i in range(2)] == [MAX_MODEL_LEN - 3, 10]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[10, 11, 12], long]
    # Streaming: every chunk has one choice; each choice's chunks add up to its text.
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {0: _expected(tiny_tokenizer, 5), 1: _expected(tiny_tokenizer, 5)}
    assert chunks[-1].usage.prompt_tokens == len(ids[0]) + len(ids[1])
    # Scoring a batch: each choice's logprobs lead with its own prompt's entries.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 0, "echo": True,
                                           "logprobs": 0})
    assert r.status_code == 200, r.text
    for choice, p, pid in zip(r.json()["choices"], prompts, ids):
        assert choice["text"] == p
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(pid)
        assert lp["token_logprobs"] == [None] + [-i / 10 for i in range(1, len(pid))]


def test_continuous_usage_stats_put_each_choices_usage_on_its_chunks(client, tiny_tokenizer):
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): every chunk of choice i
    carries i's prompt tokens and the tokens it generated so far — growing to its final count —
    and the last chunk the whole request's usage; without include_usage no chunk carries usage."""
    for kind in ("chat", "completion"):
        kw = {"model": MODEL, "max_tokens": 6, "n": 2, "stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
                      if kind == "chat" else client.completions.create(prompt="Hello there", **kw))
        per_choice: dict[int, list[int]] = {}
        for c in chunks[:-1]:
            assert c.usage is not None and len(c.choices) == 1, c
            per_choice.setdefault(c.choices[0].index, []).append(c.usage.completion_tokens)
            assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert sorted(per_choice) == [0, 1]
        for counts in per_choice.values():
            assert counts == sorted(counts) and counts[-1] == 6
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == 12
        assert {c.usage.prompt_tokens for c in chunks} == {final.usage.prompt_tokens}
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in chunks)


def test_chat_prompt_logprobs(http, engine):
    r = http.post("/v1/chat/completions", json=_chat(max_tokens=2, prompt_logprobs=0))
    assert r.status_code == 200, r.text
    prompt_ids = engine.submitted[r.json()["id"]][0]
    plp = r.json()["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(plp[1:], prompt_ids[1:]))


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_health(base_url, engine):
    assert httpx.get(base_url + "/health").status_code == 200  # no key needed
    engine.healthy = False
    try:
        assert httpx.get(base_url + "/health").status_code == 503
    finally:
        engine.healthy = True


# --------------------------------------------------------------------------------------- errors


def test_unknown_model_404(client, http):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4", messages=_user("Hi"))
    assert exc.value.status_code == 404
    err = _assert_error(
        http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model"
    )
    assert err["type"] == "NotFoundError" and "gpt-4" in err["message"]


def test_auth_401(base_url):
    body = {"model": MODEL, "messages": _user("Hi")}
    _assert_error(httpx.post(base_url + "/v1/chat/completions", json=body), 401)
    _assert_error(
        httpx.post(
            base_url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer wrong"},
        ),
        401,
    )
    _assert_error(httpx.get(base_url + "/v1/models"), 401)
    bad = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


_IMAGE_PART = {"type": "image_url", "image_url": {"url": "x"}}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": _user("Hi"), **fields}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "messages": _user("Hi"), "max_tokens": "abc"}, "max_tokens"),
        ({"model": MODEL, "messages": _user("Hi"), "max_tokens": -3}, "max_tokens"),
        ({"model": MODEL, "messages": _user("Hi"), "max_tokens": 0}, "max_tokens"),
        (_chat(max_completion_tokens=0), "max_completion_tokens"),
        ({"model": MODEL, "messages": _user("Hi"), "temperature": -0.5}, "temperature"),
        ({"model": MODEL, "messages": _user("Hi"), "top_p": 0}, "top_p"),
        (_chat(top_k=-2), "top_k"),
        (_chat(top_k=2.5), "top_k"),
        (_chat(min_p=1.5), "min_p"),
        (_chat(min_p=-0.1), "min_p"),
        (_chat(stream_options={"include_usage": True}), "stream_options"),
        (_chat(n=0), "n"),
        (_chat(n=500), "n"),
        (_chat(stop=["x", ""]), "stop"),
        (_chat(top_logprobs=3), "top_logprobs"),
        (_chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [_IMAGE_PART]}]}, "messages"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": _user("Hi"), "seed": 2**70}, "seed"),
        (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        # These used to reach the template call: a Python TypeError text, or a client's template.
        (_chat(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
        (_chat(chat_template_kwargs={"chat_template": "{{ 7 * 6 }}"}), "chat_template_kwargs"),
        (_chat(chat_template_kwargs={"continue_final_message": True}), "chat_template_kwargs"),
        (_chat(min_tokens=8, max_tokens=4), "min_tokens"),
        (_chat(min_tokens=-1), "min_tokens"),
        # penalties out of their ranges, logit_bias keys that are not token ids
        (_chat(presence_penalty=2.5), "presence_penalty"),
        (_chat(frequency_penalty=-3), "frequency_penalty"),
        (_chat(repetition_penalty=0), "repetition_penalty"),
        (_chat(logit_bias={"x": 1}), "logit_bias"),
        (_chat(logit_bias={"-1": 1}), "logit_bias"),
        # vLLM fields this build does not honour are refused, not dropped
        (_chat(prompt_logprobs=2, stream=True), "prompt_logprobs"),
        (_chat(best_of=2), "best_of"),
        (_chat(continue_final_message=True), "continue_final_message"),  # the last message is the user's
        ({"model": MODEL, "messages": [{"role": "assistant", "content": "x", "tool_calls": "notalist"}]},
         "messages.0.tool_calls"),
    ],
)
def test_chat_400(http, body, param):
    err = _assert_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert err["type"] == "BadRequestError"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only to echo the prompt
        ({"model": MODEL, "prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM's rule
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),  # --max-logprobs 20
        ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": [1, -2]}, "prompt"),
        ({"model": MODEL, "prompt": ["a", ""]}, "prompt"),  # every prompt of a batch non-empty
        ({"model": MODEL, "prompt": ["a"] * 65, "n": 2}, "prompt"),  # 130 choices in all: at most 128
        ({"model": MODEL, "prompt": [[1, 2], [1] * MAX_MODEL_LEN]}, "prompt"),  # each prompt's own room
        ({"model": MODEL, "prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": True}}, "prompt"),
        ({"model": MODEL, "prompt": [1] * MAX_MODEL_LEN}, "prompt"),
        ({"model": MODEL, "prompt": [1] * 100, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"model": MODEL, "prompt": [1] * 100, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
        ({"model": MODEL, "prompt": "x", "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"model": MODEL, "prompt": "x", "min_tokens": 17}, "min_tokens"),  # past the default max_tokens 16
        # every stop string is searched after every token: 100,000 of them stalled the event loop
        ({"model": MODEL, "prompt": "x", "stop": [f"s{i}" for i in range(1025)]}, "stop"),
        ({"model": MODEL, "prompt": "x", "stop_token_ids": [7] * 1025}, "stop_token_ids"),
    ],
)
def test_completions_400(http, body, param):
    _assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "path, raw, param",
    [
        # A lone surrogate in a stop string used to be accepted (it can never match).
        ("/v1/completions", b'{"prompt": "x", "stop": ["ok", "\\ud800"]}', "stop"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stop": "\\udc00", "stream": true}',
         "stop"),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
         "temperature"),
        ("/v1/completions", b'{"prompt": "x", "logprobs": 21}', "logprobs"),
    ],
)
def test_raw_body_400_names_the_field(http, path, raw, param):
    resp = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _assert_error(resp, 400, param)


def test_malformed_json_400(http):
    # (an integer of more than 4,300 digits is a ValueError of Python's int parser: it was a 500)
    for raw in (b'{"model": "glm-test", "messages": [', b"not json", b"[1, 2]", b"\xff\xfe",
                b'{"messages": [{"role": "user", "content": "x"}], "seed": 1' + b"0" * 5000 + b"}"):
        resp = http.post(
            "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        _assert_error(resp, 400)


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "hi"}], [{"content": "hi"}],
                                      [{"role": "assistant", "content": "x", "tool_calls": "notalist"}]])
def test_tokenize_refuses_bad_messages_with_a_400(http, messages):
    """/tokenize validates and renders messages as the chat endpoint does (these were 500s)."""
    _assert_error(http.post("/tokenize", json={"messages": messages}), 400, "messages")


def test_tokenize_and_detokenize(http, tiny_tokenizer):
    """vLLM's /tokenize (with `return_token_strs`, the served model only) and /detokenize."""
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there", "return_token_strs": True}).json()
    assert r["tokens"] == tiny_tokenizer.encode("Hello there") and r["count"] == len(r["tokens"])
    assert "".join(r["token_strs"]) == "Hello there"
    assert http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": "Hello there"}
    _assert_error(http.post("/tokenize", json={"model": "other", "prompt": "x"}), 404, "model")
    _assert_error(http.post("/detokenize", json={"tokens": [1, 10**6]}), 400, "tokens")
    _assert_error(http.post("/detokenize", json={"tokens": "x"}), 400, "tokens")
    with_prompt = http.post("/tokenize", json={"messages": _user("Hi")}).json()["count"]
    without = http.post("/tokenize", json={"messages": _user("Hi"), "add_generation_prompt": False}).json()["count"]
    assert without < with_prompt


def test_an_unhandled_error_is_a_json_500_and_the_connection_stays_usable(http, engine, monkeypatch):
    """An exception no handler knows becomes the OpenAI-style 500 without dropping the
    keep-alive connection (Starlette's error middleware used to re-raise after answering, and
    uvicorn then reset the socket: the client's next request on it failed)."""
    monkeypatch.setattr(engine, "num_unfinished_requests", lambda: 1 / 0, raising=False)
    err = _assert_error(http.get("/get_load"), 500)
    assert "ZeroDivisionError" in err["message"]
    assert http.get("/v1/models").status_code == 200  # same client, same pooled connection


def test_prompt_too_long_400(client, http):
    long_text = "one two three four five " * 200
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=_user(long_text))
    assert f"maximum context length is {MAX_MODEL_LEN}" in exc.value.message
    body = {"model": MODEL, "messages": _user("Hi"), "max_tokens": MAX_MODEL_LEN}
    err = _assert_error(http.post("/v1/chat/completions", json=body), 400, "max_tokens")
    assert str(MAX_MODEL_LEN) in err["message"] and "in the completion" in err["message"]


def test_a_context_length_below_max_model_len_is_explained_in_the_400(http, engine, monkeypatch):
    """An engine whose KV cache bounds one request below --max-model-len (Hybrid HiSparse on a small
    pool) reports that bound as its `max_model_len` with a sentence saying why; the length 400s
    carry the sentence after vLLM's message and still name the field."""
    note = " This engine's KV cache holds at most 256 tokens (prompt and output) of one request although " \
           "--max-model-len is 9216; the largest prompt this engine admits is 255 tokens: ..."
    monkeypatch.setattr(engine, "max_model_len_note", note, raising=False)
    for body, param in (({"model": MODEL, "prompt": [1] * 100, "max_tokens": 200}, "max_tokens"),
                        ({"model": MODEL, "prompt": [1] * MAX_MODEL_LEN}, "prompt")):
        err = _assert_error(http.post("/v1/completions", json=body), 400, param)
        assert f"maximum context length is {MAX_MODEL_LEN}" in err["message"] and err["message"].endswith(note)
    body = {"model": MODEL, "messages": _user("Hi"), "max_tokens": MAX_MODEL_LEN}
    err = _assert_error(http.post("/v1/chat/completions", json=body), 400, "max_tokens")
    assert err["message"].endswith(note)


def test_engine_errors(client, http, tiny_tokenizer):
    with pytest.raises(openai.BadRequestError, match="refuses"):
        client.chat.completions.create(model=MODEL, messages=_user("RAISE_VALUE"))
    with pytest.raises(openai.BadRequestError, match="refuses"):
        client.chat.completions.create(model=MODEL, messages=_user("RAISE_VALUE"), stream=True)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=_user("RAISE_BOOM"))
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt="RAISE_BOOM", stream=True)
    _assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "BOOM_LATER"}), 500
    )
    # Mid-stream failure: an in-band error event, then [DONE].
    body = {"model": MODEL, "prompt": "BOOM_LATER", "stream": True, "max_tokens": 50}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = resp.read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == 500


def test_still_serving_after_errors(client, tiny_tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=_user("Hello again"))
    assert r.choices[0].message.content == _expected(tiny_tokenizer)


# ----------------------------------------------------------------------------------- disconnects


def test_stream_disconnect_aborts(client, engine):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_user("SLOW please"),
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    first = next(it)
    rid = first.id
    stream.close()
    assert engine.wait_for(lambda: rid in engine.aborted and rid in engine.cancelled), (
        engine.aborted,
        engine.cancelled,
    )
    time.sleep(0.05)
    assert engine.aborted.count(rid) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_first_token_aborts(base_url, engine, stream):
    body = {"model": MODEL, "messages": _user("STALL"), "stream": stream}
    before = set(engine.submitted)
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream(
            "POST",
            base_url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(10, read=0.3),
        ) as resp:
            resp.read()
    assert engine.wait_for(lambda: set(engine.submitted) - before)
    (rid,) = set(engine.submitted) - before
    assert engine.wait_for(lambda: rid in engine.aborted and rid in engine.cancelled)


def test_non_stream_disconnect_aborts(base_url, engine):
    body = {"model": MODEL, "prompt": "SLOW", "max_tokens": 200, "ignore_eos": True}
    before = set(engine.submitted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            base_url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(10, read=0.3),
        )
    assert engine.wait_for(lambda: set(engine.submitted) - before)
    (rid,) = set(engine.submitted) - before
    assert engine.wait_for(lambda: rid in engine.aborted and rid in engine.cancelled)


def test_finished_requests_are_not_aborted(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=_user("Hi"), max_tokens=2)
    s = list(client.chat.completions.create(model=MODEL, messages=_user("Hi"), stream=True))
    time.sleep(0.05)
    assert r.id not in engine.aborted and s[0].id not in engine.aborted
    assert r.id not in engine.cancelled and s[0].id not in engine.cancelled


# ------------------------------------------------------------------------------- detokenization


def test_incremental_detokenizer_matches_full_decode(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ab 你好世界 🙂🙂 x" * 3) + [tiny_tokenizer.eos_token_id]
    for chunk in (1, 2, 3, 5):
        detok = IncrementalDetokenizer(tiny_tokenizer)
        deltas = []
        for i in range(0, len(ids), chunk):
            part = ids[i : i + chunk]
            deltas.append(detok.step(part, final=i + chunk >= len(ids)))
        assert "".join(deltas) == tiny_tokenizer.decode(ids)
        assert all("\ufffd" not in d for d in deltas)
    # An output cut inside a character flushes the partial bytes at the end.
    cut = tiny_tokenizer.encode("x你")[:-1]
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert detok.step(cut) == "x"
    assert detok.step([], final=True) == tiny_tokenizer.decode(cut)[1:]


# ------------------------------------------------------------------------------ app construction


def test_extra_routes_hook_and_no_api_key(tiny_tokenizer):
    from fastapi.responses import PlainTextResponse
    from fastapi.testclient import TestClient

    def add_metrics(app):
        app.add_api_route("/metrics", lambda: PlainTextResponse("vllm:num_requests_running 0\n"))

    app = build_app(FakeEngine(tiny_tokenizer), tiny_tokenizer, MODEL, extra_routes=add_metrics)
    with TestClient(app) as tc:
        assert tc.get("/metrics").text.startswith("vllm:num_requests_running")
        card = tc.get("/v1/models").json()["data"][0]  # no key configured, none needed
        assert card["id"] == card["root"] == MODEL  # no model_root given: the served name
    app = build_app(FakeEngine(tiny_tokenizer), tiny_tokenizer, MODEL, model_root="/ckpt/GLM-5.3-FP8")
    with TestClient(app) as tc:
        for card in (tc.get("/v1/models").json()["data"][0], tc.get(f"/v1/models/{MODEL}").json()):
            assert (card["id"], card["root"]) == (MODEL, "/ckpt/GLM-5.3-FP8")
        r = tc.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})  # model optional
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        _assert_error(tc.get("/no/such/route"), 404)


def test_several_served_names_are_accepted_and_answers_carry_the_first(tiny_tokenizer):
    # vLLM's `--served-model-name A B`: any name is accepted and listed; answers name the first.
    from fastapi.testclient import TestClient

    from serving.cli_args import make_arg_parser

    assert make_arg_parser().parse_args(["--served-model-name", "glm", "claude-haiku"]).served_model_name == [
        "glm", "claude-haiku"]
    app = build_app(FakeEngine(tiny_tokenizer), tiny_tokenizer, MODEL, model_aliases=[MODEL, "alias-1", "alias-1"])
    with TestClient(app) as tc:
        assert [c["id"] for c in tc.get("/v1/models").json()["data"]] == [MODEL, "alias-1"]
        assert tc.get("/v1/models/alias-1").json()["id"] == "alias-1"
        r = tc.post("/v1/completions", json={"model": "alias-1", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == MODEL
        _assert_error(tc.post("/v1/completions", json={"model": "alias-2", "prompt": "Hi", "max_tokens": 2}), 404)


def test_router_discovery_routes_need_no_api_key(tiny_tokenizer):
    # A router reads these for every worker it is given (serving/api/discovery.py); an engine
    # without KV events reports no sources and no block size.
    from fastapi.testclient import TestClient

    engine = FakeEngine(tiny_tokenizer)
    apps = [build_app(engine, tiny_tokenizer, MODEL, api_key=API_KEY, model_root="/ckpt/x") for _ in range(2)]
    infos = []
    for app in apps:
        with TestClient(app) as tc:
            infos.append(tc.get("/get_server_info").json())
            r = tc.get("/kv_event_sources")
            assert (r.status_code, r.json()) == (200, {})
    for info in infos:
        assert {k: info[k] for k in ("model_id", "model_path", "kv_block_size", "max_model_len")} == {
            "model_id": MODEL, "model_path": "/ckpt/x", "kv_block_size": None, "max_model_len": engine.max_model_len}
    # a router refuses a second event source under one instance id: every server has its own
    assert infos[0]["instance_id"] != infos[1]["instance_id"]


class _BlockingTokenizer:
    """The tiny tokenizer, except that encoding text containing "BLOCK" waits for `release`
    (standing in for a prompt of many megabytes, which takes seconds to tokenise)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text: str):
        if "BLOCK" in text:
            self.entered.set()
            self.release.wait(timeout=20)
        return self._tok.encode(text)


def test_tokenising_a_prompt_does_not_block_other_requests(tiny_tokenizer):
    # Tokenisation used to run on the event loop: one huge prompt froze every other request
    # (and /health) until it was tokenised.
    tok = _BlockingTokenizer(tiny_tokenizer)
    app = build_app(FakeEngine(tiny_tokenizer), tok, MODEL)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        result = {}
        t = threading.Thread(target=lambda: result.update(
            r=c.post("/v1/completions", json={"prompt": "BLOCK", "max_tokens": 3})))
        t.start()
        assert tok.entered.wait(timeout=10)
        try:
            assert c.get("/health").status_code == 200  # answered while the prompt is tokenised
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert "r" not in result  # the blocked request is still being tokenised
        finally:
            tok.release.set()
            t.join(timeout=10)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 3


def test_oversized_body_413_and_still_serving(tiny_tokenizer):
    # Bodies used to be read whole whatever their size (a 50 MB prompt was read, parsed and
    # tokenised before the length check refused it).
    from fastapi.testclient import TestClient

    app = build_app(FakeEngine(tiny_tokenizer), tiny_tokenizer, MODEL, max_body_bytes=2000)
    big = json.dumps({"prompt": "x" * 3000, "max_tokens": 2}).encode()
    with TestClient(app) as tc:
        hdr = {"Content-Type": "application/json"}
        _assert_error(tc.post("/v1/completions", content=big, headers=hdr), 413)
        chunks = (big[i:i + 500] for i in range(0, len(big), 500))  # no Content-Length: chunked
        _assert_error(tc.post("/v1/chat/completions", content=chunks, headers=hdr), 413)
        r = tc.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "user": "y" * 1500})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_default_body_limit_admits_a_full_context_prompt():
    from serving.api.validation import default_max_body_bytes

    for max_model_len in (256, 4096, 202_752):
        # Worst case of a legitimate prompt: every token a non-BMP character sent as a JSON
        # surrogate-pair escape (12 bytes), or a token-id list (up to 7 bytes per id).
        escaped = json.dumps({"prompt": "\U0001f642" * max_model_len}, ensure_ascii=True)
        ids = json.dumps({"prompt": [999_999] * max_model_len})
        assert max(len(escaped), len(ids)) < default_max_body_bytes(max_model_len)


# ------------------------------------------------------------------------------------ CLI flags


def test_cli_defaults_and_json_flags(caplog):
    from serving.cli_args import make_arg_parser, validate_args

    args = make_arg_parser().parse_args(
        ["--attention-config", '{"sparse_mla_force_mqa": true}', "--port", "9000"]
    )
    with caplog.at_level("WARNING", logger="serving.cli_args"):
        validate_args(args)
    assert "sparse_mla_force_mqa=true changes nothing" in caplog.text  # accepted, but not silently
    assert (args.host, args.port, args.model, args.gpu_memory_utilization) == (
        "127.0.0.1",
        9000,
        None,
        0.9,
    )
    assert args.attention_config == {"sparse_mla_force_mqa": True}
    args = make_arg_parser().parse_args(
        ["--enable-auto-tool-choice", "--tool-call-parser", "glm47", "--reasoning-parser", "glm45"]
    )
    validate_args(args)
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (True, "glm47", "glm45")


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["-dcp", "2"], "--decode-context-parallel-size"),  # no attention group of 2 devices
        (["--prefill-context-parallel-size", "0"], "--prefill-context-parallel-size"),
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["-tp", "2", "-dcp", "2", "--dcp-kv-cache-interleave-size", "3"], "--dcp-kv-cache-interleave-size"),
        (["--num-gpu-blocks-override", "1"], "--num-gpu-blocks-override"),
        (["--max-logprobs", "-1"], "--max-logprobs"),
        (["--speculative-config", '{"method": "mtp"}'], "--speculative-config"),
        (["--kv-transfer-config", "{}"], "--kv-transfer-config"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice"),  # without a tool parser
        (["--tool-call-parser", "hermes"], "--tool-call-parser"),
        (["--reasoning-parser", "deepseek_r1"], "--reasoning-parser"),
        (["--attention-config", "{not json"], "--attention-config"),
        (["--attention-config", '{"hisparse_config": {}}'], "hisparse_config needs host_pool_gib"),
        (["--attention-config", '{"hisparse_config": {"host_pool_gib": -1}}'], "host_pool_gib"),
        (["--attention-config", '{"hisparse_config": {"host_pool_gib": 1, "hot": 1}}'], "unknown key"),
        (["--attention-config", '{"hisparse_config": {"host_pool_gib": 1, "host_gather": "dma"}}'], "host_gather"),
        (["--attention-config", '{"sparse_mla_force_mqa": false}'], "--attention-config sparse_mla_force_mqa"),
        (["--attention-config", '{"sparse_mla": 1}'], "--attention-config: unknown key"),
        (["--speculative-config", "[1]"], "--speculative-config"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], "--speculative-config method"),
        (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 9}'], "num_speculative_tokens"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--responses-store-size", "-1"], "--responses-store-size"),
        (["--responses-store-max-mib", "inf"], "--responses-store-max-mib"),
        (["--responses-store-max-mib", "1e-9"], "--responses-store-max-mib"),
        (["--profiler-config", '{"profiler": "torch", "profiler_dir": "/tmp/t"}'], "--profiler-config: profiler"),
        (["--profiler-config", '{"profiler": "jax"}'], "--profiler-config: profiler_dir"),
        (["--profiler-config", '{"profiler_dir": "/etc/passwd"}'], "profiler_dir: cannot create"),
        (["--profiler-config", '{"profiler_dir": "/tmp/t", "max_steps": -1}'], "--profiler-config: max_steps"),
        (["--profiler-config", '{"profiler_dir": "/tmp/t", "python_tracer_level": 2}'], "python_tracer_level"),
        (["--profiler-config", '{"profiler_dir": "/tmp/t", "torch_profiler_dir": "x"}'], "unknown key"),
        (["--responses-store-max-mib", "0"], "--responses-store-max-mib"),
    ],
)
def test_cli_rejects_unsupported(argv, flag):
    from serving.cli_args import ArgumentError, make_arg_parser, validate_args

    with pytest.raises(ArgumentError, match=flag):
        validate_args(make_arg_parser().parse_args(argv))


def test_the_generation_configs_defaults_fill_what_a_request_leaves_out(tiny_tokenizer):
    """`build_app(default_sampling=...)` (what `--generation-config` resolves to): fields a request
    leaves out take the defaults, fields it sets win, and `max_tokens` caps the room left."""
    fake = FakeEngine(tiny_tokenizer)
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "max_tokens": 5}
    app = build_app(fake, tiny_tokenizer, MODEL, default_sampling=defaults)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": _user("Hi"),
                                                  "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        _, p = fake.submitted[r.json()["id"]]
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.6, 0.95, 20, 0.05, 5)
        r = c.post("/v1/completions", json={"prompt": "Hi", "temperature": 0, "top_p": 0.5, "top_k": -1,
                                            "min_p": 0, "max_tokens": 9, "ignore_eos": True})
        assert r.status_code == 200, r.text
        _, p = fake.submitted[r.json()["id"]]
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.0, 0.5, -1, 0.0, 9)
    plain = build_app(fake, tiny_tokenizer, MODEL)  # no generation config: the OpenAI defaults
    with live_server(plain) as url, httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi"})
        _, p = fake.submitted[r.json()["id"]]
        assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
        assert p.max_tokens == 16  # the legacy completions default, as OpenAI's and vLLM's
