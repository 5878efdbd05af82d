"""Sampling features of the HTTP layer against the deterministic fake engine of
test_api_server: stop strings (also split across tokens and stream chunks), n choices, logprobs
in both OpenAI shapes, usage with include_usage. Expected texts are computed from the fake
engine's known reply with plain string operations, independent of the server code."""

from __future__ import annotations

import json

import pytest

from serving.output_processor import StopStringMatcher
from tests.serving.test_api_server import (  # noqa: F401 (fixtures)
    API_KEY,
    MODEL,
    REPLY,
    base_url,
    client,
    engine,
    fake_logprobs,
    http,
)


def _reply_text(tokenizer) -> str:
    return tokenizer.decode(tokenizer.encode(REPLY))


def _sse_payloads(http, path, body):
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("stop", ["quick", "fox.", "! 你", "o"])
def test_completion_stop_string_excluded_and_not_streamed_past(client, http, tiny_tokenizer, stop):
    full = _reply_text(tiny_tokenizer)
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=100, stop=["zzz", stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop  # vLLM's field: the stop string that matched
    assert r.usage.completion_tokens < len(tiny_tokenizer.encode(REPLY)) + 1 or stop == "fox."
    payloads = _sse_payloads(http, "/v1/completions",
                             {"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stop": [stop, "zzz"],
                              "stream": True})
    texts = [p["choices"][0]["text"] for p in payloads]
    assert "".join(texts) == expected
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert [p["choices"][0]["stop_reason"] for p in payloads] == [None] * (len(payloads) - 1) + [stop]


def test_stop_split_across_tokens_in_chat_stream(client, tiny_tokenizer):
    ids = tiny_tokenizer.encode(REPLY)
    # A stop string that starts inside one token and ends inside a later one.
    first = tiny_tokenizer.decode(ids[:3])
    full = _reply_text(tiny_tokenizer)
    stop = full[len(first) - 1: len(first) + 3]
    assert full.index(stop) == len(first) - 1
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            stop=[stop], stream=True)
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full[: len(first) - 1]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop


def test_stop_reason_names_the_stop_token_id_that_ended_the_output(client, http, tiny_tokenizer):
    ids = tiny_tokenizer.encode(REPLY)
    stop_id = ids[4]
    assert stop_id not in ids[:4]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stop_token_ids": [stop_id], "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    # vLLM: finish_reason "stop", stop_reason the id; the id is in token_ids, its text is not in the text
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    assert choice["token_ids"] == ids[:5] and choice["text"] == tiny_tokenizer.decode(ids[:4])
    payloads = _sse_payloads(http, "/v1/completions", {**body, "stream": True})
    assert payloads[-1]["choices"][0]["stop_reason"] == stop_id
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"stop_token_ids": [stop_id]})
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", stop_id)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("length", None)


def test_stop_string_matcher_holds_back_only_possible_starts():
    m = StopStringMatcher(["abc", "xyz"])
    assert m.feed("hello a") == ("hello ", False)  # "a" may start "abc"
    assert m.feed("b") == ("", False)
    assert m.feed("d x") == ("abd ", False)
    assert m.feed("yz tail") == ("", True) and m.matched == "xyz"
    m = StopStringMatcher(["bcd", "ab", "b"])  # the earliest match wins, then list order
    assert m.feed("xabcd") == ("x", True) and m.matched == "ab"
    m = StopStringMatcher(["abc"])
    assert m.feed("xa") == ("x", False) and m.feed("", final=True) == ("a", False)


def test_n_choices_non_stream_and_stream(client, http, engine, tiny_tokenizer):
    full = _reply_text(tiny_tokenizer)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                       seed=7, max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    five = tiny_tokenizer.decode(tiny_tokenizer.encode(REPLY)[:5])
    assert all(c.message.content == five for c in r.choices)
    assert r.usage.completion_tokens == 15
    seeds = sorted(engine.submitted[f"{r.id}-{i}"][1].seed for i in range(3))
    assert seeds == [7, 8, 9]
    payloads = _sse_payloads(http, "/v1/completions",
                             {"model": MODEL, "prompt": "Hi", "n": 2, "max_tokens": 100, "stream": True,
                              "stream_options": {"include_usage": True}})
    texts = {0: "", 1: ""}
    finishes = {}
    for p in payloads[:-1]:
        c = p["choices"][0]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert texts == {0: full, 1: full} and finishes == {0: "stop", 1: "stop"}
    usage = payloads[-1]["usage"]
    n_reply = len(tiny_tokenizer.encode(REPLY)) + 1
    assert payloads[-1]["choices"] == [] and usage["completion_tokens"] == 2 * n_reply
    assert usage["prompt_tokens"] == len(tiny_tokenizer.encode("Hi"))


def test_chat_logprobs_shape_and_values(client, tiny_tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, logprobs=True, top_logprobs=3)
    ids = tiny_tokenizer.encode(REPLY)[:4]
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tiny_tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert all(c.logprob == -0.25 for c in content)
    assert [[x.logprob for x in c.top_logprobs] for c in content] == [[-0.25, -1.0, -2.0]] * 4
    assert content[0].bytes == list(content[0].token.encode("utf-8"))
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, logprobs=True)
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].logprobs is None


def test_chat_stream_logprobs_cover_every_token(client, tiny_tokenizer):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=9, logprobs=True, top_logprobs=1, stream=True)
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    ids = tiny_tokenizer.encode(REPLY)[:9]
    assert [e.token for e in entries] == [tiny_tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_completion_logprobs_shape(client, tiny_tokenizer):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    ids = tiny_tokenizer.encode(REPLY)[:3]
    toks = [tiny_tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.tokens == toks and lp.token_logprobs == [-0.25] * 3
    assert lp.text_offset == [0, len(toks[0]), len(toks[0]) + len(toks[1])]
    second = tiny_tokenizer.decode([ids[0] + 1], skip_special_tokens=False)
    assert lp.top_logprobs[0] == {toks[0]: -0.25, second: -1.0}


def test_stop_strings_are_not_matched_before_min_tokens(client, tiny_tokenizer):
    """vLLM's rule: a stop string in the text of the first `min_tokens` tokens does not end the
    output; the first one after it does (expected text from the reply's own tokens)."""
    ids = tiny_tokenizer.encode(REPLY)
    full = _reply_text(tiny_tokenizer)
    k = next(n for n in range(1, len(ids)) if "o" in tiny_tokenizer.decode(ids[:n]))  # an "o" inside
    head = tiny_tokenizer.decode(ids[:k])
    assert full.startswith(head) and "o" in full[len(head):]
    expected = head + full[len(head):][: full[len(head):].index("o")]
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=100, stop=["o"], extra_body={"min_tokens": k})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].stop_reason) == (expected, "stop", "o")
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=100, stop=["o"])
    assert r.choices[0].text == full[: full.index("o")]  # without it, the first "o" ends the output
