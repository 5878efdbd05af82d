"""P/D through a real vllm-router subprocess: a prefill server and a decode server (each its own
process on 4 simulated devices), the router in `--vllm-pd-disaggregation` mode in front, the
openai client talking to the router. Streams (completions and chat, streaming and not) must
equal the decode server's own colocated answers; the decode server's metrics must show every
prompt's KV but the last token pulled, none failed; malformed params are 400s naming the field."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from tests.helpers.router_process import ROUTER, free_port, vllm_router
from tests.helpers.server_process import server_process
from tests.helpers.shallow_model import shallow_model_argv

pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (the `pd` extra)")

MODEL = "glm-5.3-tiny"
# The servers run the suite's 7-layer twin of the tiny checkpoint (tests/helpers/shallow_model.py:
# the same structures, half the layers to compile at start-up) under the tiny model's name.
TWIN = shallow_model_argv(MODEL)
COMMON = [*TWIN, "--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--cuda-graph-sizes", "--precompile-token-paddings",
          "--dtype", "float32", "--disable-log-stats", "--enable-prefix-caching"]
# The prefill server as in the reference: the P/D connector and the CPU KV offload (MultiConnector),
# on a device pool small enough (24 pages) that an earlier turn's pages leave the device.
PREFILL_CONFIG = {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
    "connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
                   {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 256 * 2**20}}]}}
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def _config(role: str) -> list[str]:
    if role == "kv_producer":
        return ["--num-gpu-blocks-override", "24", "--kv-transfer-config", json.dumps(PREFILL_CONFIG)]
    return ["--kv-transfer-config", json.dumps({"kv_connector": "JaxTransferConnector", "kv_role": role})]


@contextlib.contextmanager
def router_process(prefill_url: str, decode_url: str):
    args = ["--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url, "--prefill-policy",
            "cache_aware", "--decode-policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port",
            str(free_port()), "--log-level", "warning"]
    with vllm_router(args) as (url, _log):
        yield url


@pytest.fixture(scope="module")
def pd_servers():
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(server_process(COMMON + _config("kv_producer"), env=ENV))
        decode = stack.enter_context(server_process(COMMON + _config("kv_consumer"), env=ENV))
        router = stack.enter_context(router_process(prefill.url, decode.url))
        yield prefill, decode, router


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


PROMPTS = [[(7 * i) % 300 + 4 for i in range(70)], [(13 * i) % 400 + 4 for i in range(130)]]


def test_openai_client_through_vllm_router_equals_colocated(pd_servers):
    import openai

    prefill, decode, router = pd_servers
    via = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    direct = openai.OpenAI(base_url=decode.url + "/v1", api_key="unused")
    before = _metric(decode.url, "vllm:kv_transfer_remote_prompt_tokens_total")
    pulled = 0
    for prompt in PROMPTS:
        kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        want = direct.completions.create(**kw).choices[0].text
        assert via.completions.create(**kw).choices[0].text == want
        assert "".join(c.choices[0].text for c in via.completions.create(**kw, stream=True) if c.choices) == want
        pulled += 2 * (len(prompt) - 1)
    msgs = [{"role": "user", "content": "the river is quiet. 7ing. the old bridge. 12ach. What is 7?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    want = direct.chat.completions.create(**kw).choices[0].message.content
    assert via.chat.completions.create(**kw).choices[0].message.content == want
    got = "".join(c.choices[0].delta.content or "" for c in via.chat.completions.create(**kw, stream=True)
                  if c.choices)
    assert got == want
    # Every routed request's prompt but its last token came from the prefill server.
    after = _metric(decode.url, "vllm:kv_transfer_remote_prompt_tokens_total")
    assert after - before >= pulled + 2  # + the two chat prompts (their length depends on the template)
    assert _metric(decode.url, "vllm:nixl_num_failed_transfers_total") == 0
    assert _metric(prefill.url, "vllm:kv_transfer_held_requests") == 0  # all staged and released
    assert httpx.get(prefill.url + "/health").status_code == httpx.get(decode.url + "/health").status_code == 200


def test_structured_outputs_through_the_router_equal_the_decode_servers_own(pd_servers):
    """A chat JSON schema and a completion choice (`structured_outputs`) through the router: the
    answers equal the decode server's own (colocated) answers and validate."""
    import jsonschema
    import openai

    _, decode, router = pd_servers
    via = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    direct = openai.OpenAI(base_url=decode.url + "/v1", api_key="unused")
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["x", "ok"], "additionalProperties": False}
    # (vLLM's `structured_outputs` rather than `response_format`: the random-weight model fills
    # every whitespace the schema allows, so it needs disable_any_whitespace to finish in 40 tokens.)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Give me x and ok as JSON."}], max_tokens=40,
              temperature=0, extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    want = direct.chat.completions.create(**kw).choices[0].message.content
    before = _metric(decode.url, "vllm:kv_transfer_remote_prompt_tokens_total")
    got = via.chat.completions.create(**kw)
    assert got.choices[0].message.content == want and got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want), schema)
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
              extra_body={"structured_outputs": {"choice": ["red", "green", "dark blue"]}})
    want = direct.completions.create(**kw).choices[0].text
    assert via.completions.create(**kw).choices[0].text == want and want in ("red", "green", "dark blue")
    # Both routed requests' prompts (but their last tokens) came from the prefill server.
    assert _metric(decode.url, "vllm:kv_transfer_remote_prompt_tokens_total") - before >= len(PROMPTS[1]) - 1 + 1
    assert _metric(decode.url, "vllm:nixl_num_failed_transfers_total") == 0


def test_malformed_kv_transfer_params_are_400s_naming_the_field(pd_servers):
    prefill, decode, _ = pd_servers
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}
    cases = [({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill"),
             ({"do_remote_prefill": True, "remote_host": "127.0.0.1"}, "kv_transfer_params.remote_port"),
             ("nope", "kv_transfer_params")]
    for params, field in cases:
        r = httpx.post(decode.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    # A prefill answer for another prompt, and one of another KV layout, are refused before anything moves.
    kp = httpx.post(prefill.url + "/v1/completions", json={**body, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}, timeout=60).json()["kv_transfer_params"]
    r = httpx.post(decode.url + "/v1/completions", json={**body, "prompt": PROMPTS[1], "kv_transfer_params": kp})
    assert r.status_code == 400 and "prompt_hash" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "kv_transfer_params.prompt_hash"
    bad = {**kp, "kv_layout": {**kp["kv_layout"], "groups": {"mla": [["mla", 14, 144, "bfloat16", 0]],
                                                              "indexer": kp["kv_layout"]["groups"]["indexer"]}}}
    r = httpx.post(decode.url + "/v1/completions", json={**body, "kv_transfer_params": bad})
    assert r.status_code == 400 and "kv-cache-dtype" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "kv_transfer_params.kv_layout"
    # A streamed do_remote_decode request would hold KV whose parameters no stream carries: refused.
    r = httpx.post(prefill.url + "/v1/completions", json={**body, "stream": True,
                                                          "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    # A do_remote_decode request to the decode-only server is refused naming the role.
    r = httpx.post(decode.url + "/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "kv_producer" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "kv_transfer_params.do_remote_decode"
    # The good params still work afterwards: the prefill server kept the KV.
    r = httpx.post(decode.url + "/v1/completions", json={**body, "kv_transfer_params": kp}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPTS[0]) - 1


def test_multiturn_through_the_router_reuses_the_prefill_host_tier_and_the_decode_prefix_cache(pd_servers):
    """Turn 2 of a conversation after another long request pushed turn 1 off the prefill server's
    device pool: the prefill server finds it in its offload tier, the decode server in its own
    prefix cache (so the pull is small); the answer equals the decode server's colocated one."""
    prefill, decode, router = pd_servers
    turn1 = [(7 * i) % 300 + 4 for i in range(900)]
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    b0 = _metric(decode.url, "vllm:nixl_bytes_transferred_sum")
    out1 = httpx.post(router + "/v1/completions", json={**body, "prompt": turn1, "return_token_ids": True},
                      timeout=120).json()
    turn1_bytes = _metric(decode.url, "vllm:nixl_bytes_transferred_sum") - b0
    other = [(11 * i) % 350 + 4 for i in range(900)]
    httpx.post(router + "/v1/completions", json={**body, "prompt": other}, timeout=120).raise_for_status()
    ext_before = _metric(prefill.url, "vllm:external_prefix_cache_hits_total")
    bytes_before = _metric(decode.url, "vllm:nixl_bytes_transferred_sum")
    turn2 = turn1 + out1["choices"][0]["token_ids"] + [(5 * i) % 200 + 4 for i in range(30)]
    got = httpx.post(router + "/v1/completions", json={**body, "prompt": turn2}, timeout=120).json()
    moved = _metric(decode.url, "vllm:nixl_bytes_transferred_sum") - bytes_before
    assert _metric(prefill.url, "vllm:external_prefix_cache_hits_total") > ext_before  # the offload tier served
    assert 0 < moved < 0.4 * turn1_bytes  # past the first indexer page (768 tokens) only
    want = httpx.post(decode.url + "/v1/completions", json={**body, "prompt": turn2}, timeout=120).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
