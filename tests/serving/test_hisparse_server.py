"""The server with the reference deployment's flag (`--attention-config '{"hisparse_config":
{"host_pool_gib": N}}'`) on the tiny checkpoint and a device pool too small for its requests,
driven by the `openai` client over loopback: concurrent long requests keep decoding through the hot
buffer with nobody preempted, their greedy text equals the same requests served one at a time
(fully resident), and the HiSparse counters and gauges move on /metrics."""

import concurrent.futures as cf

import httpx
import openai
import pytest

from serving.run import build_server
from tests.helpers.live_server import live_server

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

ARGV = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "1536", "--enable-prefix-caching",
        "--num-gpu-blocks-override", "32", "--log-level", "warning", "--cuda-graph-sizes", "--precompile-token-paddings",
        "--attention-config", '{"hisparse_config": {"host_pool_gib": 0.04}}']
MODEL = "glm-5.3-tiny"
LAB = (("model_name", MODEL),)


@pytest.fixture(scope="module")
def server():
    app, args, engine = build_server(ARGV)
    with live_server(app) as base_url:
        yield base_url, engine
    engine.shutdown()
    assert engine.engine.audit() == []
    assert engine.engine.pool.num_free == engine.engine.pool.num_usable_blocks, "KV pages leaked"


def _metrics(base):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base + "/metrics", timeout=30)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_concurrent_long_requests_under_pressure_match_one_at_a_time(server):
    base, engine = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [[(7 * i + 31 * k) % 470 + 10 for i in range(900)] for k in range(4)]

    def complete(p):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    alone = [complete(p) for p in prompts]  # one at a time: every page stays resident
    before = _metrics(base)
    with cf.ThreadPoolExecutor(4) as ex:
        together = list(ex.map(complete, prompts))
    after = _metrics(base)
    assert together == alone

    def delta(name):
        return after.get((name, LAB), 0) - before.get((name, LAB), 0)

    assert delta("vllm:hisparse_cache_misses_total") > 0
    assert delta("vllm:hisparse_host_to_device_bytes_total") > 0
    assert ("vllm:hisparse_cache_hits_total", LAB) in after
    assert delta("vllm:num_preemptions_total") == 0
    states = {dict(k[1])["state"] for k in after if k[0] == "vllm:hisparse_requests"}
    assert states == {"full", "mixed", "none"}
    assert 0 <= after[("vllm:hisparse_host_pool_usage_perc", LAB)] <= 1
    assert engine.engine.hisparse.device.drops_outside_truncation == 0
    # rows of truncated prefill chunks (adaptive sizing) are counted on /metrics as on the policy
    assert after[("vllm:hisparse_prefill_rows_recomputed_total", LAB)] == engine.engine.hisparse.policy.num_truncated_rows
    # the release machinery's counters are the policy's
    pol = engine.engine.hisparse.policy
    for name, value in (("pages_released", pol.num_released), ("shared_pages_released", pol.num_released_shared),
                        ("requests_revived", pol.num_revived), ("squeezed_lease_steps", pol.num_squeezed_steps)):
        assert after[(f"vllm:hisparse_{name}_total", LAB)] == value
