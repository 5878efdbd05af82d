"""The server process's lifecycle (`serving/lifecycle.py`), as a supervisor sees it, on real
subprocesses: SIGTERM drains (new requests and `/health` get 503 with an OpenAI error body, the
running stream finishes, exit 0); a second signal exits at once; an engine whose device state is
lost answers 500, reports 503 on `/health` and exits 1."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.helpers.server_process import server_process

# The same engine settings as test_e2e_server (its compiled steps are in the shared cache).
ARGV = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "1024", "--enable-prefix-caching",
        "--log-level", "info", "--cuda-graph-sizes", "--precompile-token-paddings"]


def stream_completion(url: str, max_tokens: int, result: dict, first: threading.Event) -> None:
    """Stream a greedy completion; record chunks, finish reason and any error into `result`."""
    body = {"model": "glm-5.3-tiny", "prompt": "Tell me a long story", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    result.update(tokens=0, finish=None, error=None, done=False)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                result["done"] = result["done"] or line == "data: [DONE]"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                for c in d.get("choices", []):
                    result["tokens"] += 1
                    result["finish"] = c.get("finish_reason") or result["finish"]
                    first.set()
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    finally:
        first.set()


def start_stream(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    result, first = {}, threading.Event()
    t = threading.Thread(target=stream_completion, args=(url, max_tokens, result, first), daemon=True)
    t.start()
    assert first.wait(120), "no first token"
    return t, result


def test_sigterm_drains_running_requests_then_exits_zero():
    with server_process(ARGV + ["--shutdown-timeout", "120"]) as srv:
        t, result = start_stream(srv.url, 120)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "ServiceUnavailableError" and r.json()["error"]["code"] == 503
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
        t.join(120)
        assert result["error"] is None and result["finish"] == "length" and result["tokens"] == 120, result
        assert srv.proc.wait(60) == 0, srv.log()[-3000:]
        assert "drained; exiting" in srv.log()


def test_streams_still_running_at_the_shutdown_deadline_end_properly():
    """At --shutdown-timeout the running requests are aborted: the stream gets its last chunk
    (finish_reason "abort") and [DONE] instead of a cut connection, and the process exits 0
    soon after the deadline (not uvicorn's own 5 s later)."""
    with server_process(ARGV + ["--shutdown-timeout", "1"]) as srv:
        t, result = start_stream(srv.url, 900)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert result["error"] is None and result["finish"] == "abort" and result["done"], result
        assert result["tokens"] < 900
        assert srv.proc.wait(60) == 0, srv.log()[-3000:]
        assert time.monotonic() - t0 < 1 + 4, srv.log()[-3000:]
        assert "aborted 1 (finish_reason abort)" in srv.log()


def test_a_second_signal_exits_at_once():
    with server_process(ARGV + ["--shutdown-timeout", "300"]) as srv:
        t, result = start_stream(srv.url, 900)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        code = srv.proc.wait(60)
        assert code != 0 and time.monotonic() - t0 < 30, srv.log()[-3000:]
        t.join(30)
        assert result["tokens"] < 900  # the stream was cut, not drained
        assert "second signal" in srv.log()


def test_a_lost_device_state_answers_500_reports_503_and_exits_one():
    with server_process(ARGV, env={"GLM53_FAULT_INJECTION": "device_lost@2"}) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 500 and "device state was lost" in r.json()["error"]["message"], r.text
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        assert srv.proc.wait(60) == 1, srv.log()[-3000:]
        assert "the engine died" in srv.log()
