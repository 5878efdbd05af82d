"""KV events in front of a real vllm-router: two servers (each its own process, one simulated
device) publish `--kv-events-config` events; `vllm-router --policy kv_aware`, given nothing but
the two worker URLs, finds each server's event socket and block size itself (`GET
/kv_event_sources`, `GET /get_server_info`: serving/api/discovery.py), subscribes to both and
routes. Four conversations start on alternate servers (sent there
directly); their later turns go through the router and must land on the server holding the
conversation, which shows in the answer's `cached_tokens` (at least the previous prompt, to the
64-token unit; the other server would hit nothing). With the events switched off the router
sends them all to one server and half of them miss."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from tests.helpers.router_process import ROUTER, vllm_router
from tests.helpers.router_process import free_port as _free_port
from tests.helpers.server_process import server_process
from tests.helpers.shallow_model import shallow_model_argv

pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (the `pd` extra)")

MODEL = "glm-5.3-tiny"
# The servers run the suite's 7-layer twin of the tiny checkpoint (tests/helpers/shallow_model.py:
# the same structures, half the layers to compile at start-up) under the tiny model's name.
TWIN = shallow_model_argv(MODEL)
COMMON = [*TWIN, "--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--cuda-graph-sizes",
          "--precompile-token-paddings", "--dtype", "float32", "--disable-log-stats", "--enable-prefix-caching"]
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def _events_flag(port: int) -> list[str]:
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://*:{port}"})]


def kv_router(urls: list[str]):
    """vllm-router kv_aware over the servers at `urls`, with no event flags: it discovers them."""
    return vllm_router(["--policy", "kv_aware", "--worker-urls", *urls, "--log-level", "debug"])


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_later_turns_go_to_the_server_holding_the_conversation():
    ports = [_free_port(), _free_port()]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(server_process(COMMON + _events_flag(p), env=ENV)) for p in ports]
        router, router_log = stack.enter_context(kv_router([s.url for s in servers]))
        time.sleep(1.0)  # the router's subscribers connect
        client = httpx.Client(timeout=120)
        convs = [[{"role": "user", "content": f"Conversation {c}: " + "tell me about the sea and the hills " * 12}]
                 for c in range(4)]
        first_cached, later = [], []  # later: (cached tokens, the previous turn's prompt tokens)
        prev_prompt: dict[int, int] = {}
        for turn in range(3):
            for c, msgs in enumerate(convs):
                # Turn 0 goes straight to server c % 2, so the conversations live on both; the
                # later turns go through the router, which only the events tell where they are.
                url = servers[c % 2].url if turn == 0 else router
                r = client.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                                                                    "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                body = r.json()
                usage = body["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if turn == 0:
                    first_cached.append(cached)
                else:
                    later.append((cached, prev_prompt[c]))
                prev_prompt[c] = usage["prompt_tokens"]
                msgs += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And turn {turn + 1} of conversation {c}?"}]
                time.sleep(0.3)  # the events of this turn reach the router
        # Every later turn hit at least its whole previous prompt (to the unit): it went to the
        # server holding it. With the other server it would have hit nothing.
        assert all(c == 0 for c in first_cached)
        for cached, earlier in later:
            assert cached >= earlier // 64 * 64 > 0, later
        published = [_metric(s.url, "vllm:kv_events_published_total") for s in servers]
        stored = [_metric(s.url, "vllm:kv_event_blocks_stored_total") for s in servers]
        assert sum(published) > 0 and sum(stored) > 0, (published, stored)
        assert all(_metric(s.url, "vllm:kv_events_dropped_total") == 0 for s in servers)
    with open(router_log, errors="replace") as f:
        log = f.read()
    # the router subscribed to each server's discovered socket (`*` read as the URL's host)
    for p in ports:
        assert f"on tcp://127.0.0.1:{p}" in log, f"no subscriber for port {p}"
    decisions = [line for line in log.splitlines() if "KV prefix decision" in line]
    assert any("credited_prefix_tokens=0" not in line for line in decisions), decisions[-3:]
