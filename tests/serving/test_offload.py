"""The CPU KV offloading connector (`serving/offload/`, `--kv-transfer-config`) in the real engine
(the tiny checkpoint's 7-layer twin, CPU): host-tier prefix hits give the cold run's tokens and
logprobs without recomputing the hit; concurrent identical and overlapping prompts under eviction
pressure give the one-by-one outputs; the agentic multi-turn workload's greedy streams equal the
ample-pool run's, alone and under Hybrid HiSparse (where it manages the indexer keys only); bad
flags fail naming the key; every pool and host-store audit is clean."""

from __future__ import annotations

import numpy as np
import pytest

from glm53 import api
from glm53.equality import compare_streams
from serving.cli_args import ArgumentError, make_arg_parser, validate_args
from serving.offload import OffloadConfig, OffloadConfigError
from serving.types import SamplingParams
from tests.helpers.conversations import run_conversations
from tests.serving.test_hisparse_engine import (
    AMPLE,
    AMPLE_MAX_MODEL_LEN,
    CONV,
    HISPARSE,
    SMALL,
    engine,
    mean_running,
)

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

GiB = 2**30


def indexer_page(e) -> int:
    """Tokens of one indexer page, the group with the largest page: host-tier hits come in whole
    indexer pages (only full pages are stored). A page is a fixed number of bytes, so this depends
    on the checkpoint: 768 on the 14-layer tiny checkpoint, 448 on its 7-layer twin."""
    return e.kv.group("indexer").tokens_per_page


def offload_flag(nbytes: int = GiB // 16) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": nbytes}}


def run_one(e, rid, prompt, max_tokens=8):
    """Greedy run of one request; (tokens, logprobs, cached tokens, prompt tokens computed)."""
    computed = []
    orig = e.scheduler.schedule

    def schedule():
        out = orig()
        computed.extend(sr.num_new_tokens for sr in out.scheduled if sr.request_id == rid and
                        sr.start_pos < len(prompt))
        return out

    e.scheduler.schedule = schedule
    try:
        e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
        toks, lps, cached = [], [], None
        while e.has_unfinished_requests():
            for o in e.step():
                if o.request_id == rid:
                    toks += o.new_token_ids
                    lps += o.new_logprobs or []
                    cached = o.num_cached_tokens
    finally:
        e.scheduler.schedule = orig
    return toks, lps, cached, sum(computed)


def assert_clean(e):
    assert e.audit() == []
    e.step()  # idle: queued stores are flushed
    assert e.audit() == []
    assert e.pool.num_free == e.pool.num_usable_blocks
    st = e.offload.store
    assert not st.queue and not st.in_flight and not st.pinned
    assert st.blocks.num_free == st.num_usable  # filed blocks sit in the LRU free queue


@pytest.fixture(scope="module")
def small():
    return engine(SMALL, "bfloat16", kv_transfer_config=offload_flag())


def test_a_prefix_evicted_from_the_device_comes_back_from_the_host(small):
    e = small
    idx = indexer_page(e)
    rng = np.random.default_rng(0)
    # 1,000 tokens: the largest hit the prompt allows (960, whole 64-token units) is not a whole
    # number of indexer pages on the twin (448: 896) nor on the tiny checkpoint (768), so the hit
    # below shows that it ends at an indexer page. (900 tokens did that at 768 but gives 896 = 2 x
    # 448 on the twin, where that limit and the indexer page coincide.)
    prompt = rng.integers(10, 490, 1000).tolist()
    cold = run_one(e, "cold", prompt)
    assert cold[2] == 0 and cold[3] == len(prompt)
    stored = e.offload.store.num_stored
    assert stored >= len(prompt) // 64 + len(prompt) // idx  # every full MLA and indexer page of the prompt
    for i in range(3):  # other prompts take the device pages back: the device cache loses the prefix
        run_one(e, f"evict{i}", rng.integers(10, 490, 900).tolist())
    ext0, loaded0 = e.prefix_cache.external_hits, e.offload.store.num_loaded
    warm = run_one(e, "warm", prompt)
    hit = warm[2]
    # The hit ends at the last whole indexer page (its pages are the largest, and only full pages
    # are stored), short of the prompt's 64-token limit.
    assert hit == (len(prompt) - 1) // idx * idx < (len(prompt) - 1) // 64 * 64
    assert e.prefix_cache.external_hits - ext0 == hit
    assert warm[3] == len(prompt) - hit, "the host-tier hit was recomputed"
    assert e.offload.store.num_loaded - loaded0 == hit // 64 + hit // idx  # its MLA pages + indexer pages
    assert warm[0] == cold[0]
    np.testing.assert_allclose([x.logprob for x in warm[1]], [x.logprob for x in cold[1]], rtol=0, atol=1e-5)
    assert_clean(e)


def test_concurrent_identical_and_overlapping_prompts_match_one_by_one(small):
    """Three shared 800-token heads, each with several tails, some prompts identical: run one by
    one, then all at once (twice), on a pool that cannot keep them: stores and loads interleave
    with evictions, and every output must be the one-by-one output."""
    e = small
    rng = np.random.default_rng(1)
    heads = [rng.integers(10, 490, 800).tolist() for _ in range(3)]
    prompts = []
    for i in range(9):
        tail = rng.integers(10, 490, 40 + 30 * (i % 3)).tolist()
        prompts.append(heads[i % 3] + tail)
    prompts += [prompts[0], prompts[4]]  # identical prompts
    alone = [run_one(e, f"alone{i}", p, 6)[0] for i, p in enumerate(prompts)]
    for rep in range(2):
        outs = {}
        for i, p in enumerate(prompts):
            e.add_request(f"r{rep}-{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            outs[f"r{rep}-{i}"] = []
        while e.has_unfinished_requests():
            for o in e.step():
                outs[o.request_id] += o.new_token_ids
            assert e.audit() == []
        assert [outs[f"r{rep}-{i}"] for i in range(len(prompts))] == alone
    assert e.prefix_cache.external_hits > 0 and e.offload.store.num_loaded > 0
    assert_clean(e)


def test_kv_events_announce_the_offload_tier(small):
    """KV events (serving/kv_events/) over the connector's store: after the device lost a prefix,
    the subscriber's rebuilt view (tests/helpers/kv_event_view.py) credits it on the CPU medium
    with exactly the engine's own hit."""
    from serving.request import Request
    from tests.helpers.kv_event_view import RouterView
    from tests.serving.test_kv_events import _drain

    e = small
    idx, unit = indexer_page(e), e.prefix_cache.unit
    tracker = e.prefix_cache.track_events()
    view = RouterView()
    rng = np.random.default_rng(5)
    # 1,000 tokens, as in the first test: the device hit (960) and the host one (whole indexer
    # pages: 896 on the twin) differ, as 896 and 768 did with 900 tokens on the tiny checkpoint.
    prompt = rng.integers(10, 490, 1000).tolist()
    probe = prompt + [7]
    device_hit, host_hit = (len(probe) - 1) // unit * unit, (len(probe) - 1) // idx * idx
    assert host_hit < device_hit

    def engine_hit():
        return e.prefix_cache.lookup(Request("probe", probe, SamplingParams())).num_tokens

    run_one(e, "ev-cold", prompt)
    e.step()  # idle: the queued stores are filed
    _drain(tracker, view)
    assert view.block_size == unit == 64
    assert view.hit_tokens(probe, media=("GPU",)) == engine_hit() == device_hit
    for i in range(3):
        run_one(e, f"ev-evict{i}", rng.integers(10, 490, 900).tolist())
    e.step()
    _drain(tracker, view)
    assert view.hit_tokens(probe, media=("GPU",)) < host_hit
    assert view.hit_tokens(probe) == view.hit_tokens(probe, media=("CPU",)) == engine_hit() == host_hit
    assert view.media() == tracker.published()
    assert_clean(e)


@pytest.fixture(scope="module")
def ample_agentic():
    """The agentic workload on the ample pool (the reference of both modes below), run once."""
    return run_conversations(engine(AMPLE, "bfloat16", max_model_len=AMPLE_MAX_MODEL_LEN), logprobs=2, **CONV)


@pytest.mark.parametrize("mode", ["offload", "hisparse+offload"])
def test_agentic_streams_equal_the_ample_run(mode, ample_agentic):
    lm = api.load(cache_dtype="bfloat16")
    ample = ample_agentic
    hs = HISPARSE if mode == "hisparse+offload" else None
    # Without HiSparse, 37 pages: on the 7-layer twin two 950-token first turns need 18 pages each,
    # so the 36-page pool (35 usable) would run one request at a time; with one page more two run
    # side by side and the pool still evicts (preemptions, host-tier hits), as on 14 layers.
    e = engine(SMALL if hs else SMALL + 1, "bfloat16", hs, kv_transfer_config=offload_flag())
    forgotten = []

    def idle_conversation_0(e, step):
        """Conversation 0's user is slow to come back: by the time its next turn is admitted the
        device cache has handed out its pages (`PrefixCache.reset` forgets every free page)."""
        if any(r.request_id.startswith("c0t") and r.request_id != "c0t0" and r.num_computed_tokens == 0
               for r in e.scheduler.waiting):
            forgotten.append(e.prefix_cache.reset())

    # Under HiSparse the connector holds the indexer keys of idle prefixes (docs/hisparse.md), but
    # in this workload the device never hands one out: finished turns' MLA pages (front tier) are
    # reused before cached indexer pages, and continuations are admitted first, each as soon as its
    # previous turn ends. On the 14-layer checkpoint one running request's lease growth once took
    # an idle conversation's indexer pages (one 768-token host-tier hit, by chance); on the 7-layer
    # twin nothing does (tried: pools of 28 to 48 pages, 3 to 6 conversations, 1,300-token first
    # turns, 300 new tokens a turn). So conversation 0 idles between turns: its returning turns take
    # their indexer pages from the connector and their MLA rows from the HiSparse host pool; the
    # other conversations keep their device-local hits unless they wait at that moment too.
    run = run_conversations(e, on_step=idle_conversation_0 if hs else None, **CONV)
    st = e.offload.store
    print(f"\n{mode}: mean running {mean_running(run):.2f}, {e.scheduler.num_preemptions_total} preemptions, "
          f"external hits {e.prefix_cache.external_hits} of {e.prefix_cache.external_queries} tokens, "
          f"{st.num_stored} pages stored, {st.num_loaded} loaded, {sum(forgotten)} device pages forgotten")
    compare_streams(ample.outputs, run.outputs, ample.logprobs, ample.prompts, lm)
    assert max(run.running) >= 2, "requests never ran side by side: the pool is too small for the test's point"
    assert st.groups == (("indexer",) if hs else ("mla", "indexer"))
    assert e.prefix_cache.external_hits > 0
    if hs:
        assert e.scheduler.num_preemptions_total == 0
    assert_clean(e)


@pytest.mark.parametrize("flag, match", [
    ('{"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {"cpu_bytes_to_use": 1}}',
     "kv_connector 'LMCacheConnectorV1'"),
    ('{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1e9, "x": 1}}',
     r"unknown key\(s\) \['x'\]"),
    ('{"kv_connector": "OffloadingConnector", "kv_buffer": 1, "kv_connector_extra_config": {}}',
     r"unknown key\(s\) \['kv_buffer'\]"),
    ('{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": -5}}',
     "cpu_bytes_to_use must be a positive"),
    ('{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1e9, '
     '"spec_name": "GPUSpec"}}', "spec_name 'GPUSpec'"),
    ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
     '{"cpu_bytes_to_use": 1e9}}', "kv_role 'kv_producer'"),
    ('{"kv_connector": "OffloadingConnector"', "--kv-transfer-config"),
])
def test_bad_kv_transfer_config_fails_at_start_up_naming_the_key(flag, match):
    args = make_arg_parser().parse_args(["--kv-transfer-config", flag, "--enable-prefix-caching"])
    with pytest.raises(ArgumentError, match=match):
        validate_args(args)


def test_the_reference_flag_is_accepted_and_needs_prefix_caching(caplog):
    ref = ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
           '{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":137438953472}}')
    args = make_arg_parser().parse_args(["--kv-transfer-config", ref, "--enable-prefix-caching"])
    validate_args(args)
    with caplog.at_level("WARNING", logger="serving.offload.config"):
        assert OffloadConfig.from_dict(args.kv_transfer_config).cpu_bytes_to_use == 128 * GiB
    assert "spec_name 'TieringOffloadingSpec' runs as CPUOffloadingSpec" in caplog.text  # not silently
    with pytest.raises(ArgumentError, match="--enable-prefix-caching"):
        validate_args(make_arg_parser().parse_args(["--kv-transfer-config", ref]))
    with pytest.raises(OffloadConfigError, match="exceeds"):
        engine(SMALL, "bfloat16", kv_transfer_config=offload_flag(1 << 50))


@pytest.mark.parametrize("layout", [["--tensor-parallel-size", "8"],
                                    ["--data-parallel-size", "8", "--enable-expert-parallel"],
                                    ["-pcp", "8", "-dcp", "8", "--enable-expert-parallel"]],
                         ids=["tp8", "dp8_ep", "pcp8_dcp8_ep"])
def test_the_reference_node_commands_pass_the_start_up_checks(layout):
    """docs/gpu_deployment.md's reference commands (HiSparse, the connector and MTP3 on the node's
    layout: the single node's TP8, the disaggregated deployment's DP8 + EP decode engine and its
    PCP8 × DCP8 prefill engine, which the reference runs without HiSparse) pass every start-up
    check that needs no model or device."""
    from serving.cli_args import parallel_config

    ref = ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
           '{"cpu_bytes_to_use":137438953472}}')
    argv = [*layout, "--kv-cache-dtype", "fp8", "--max-model-len", "142000", "--enable-prefix-caching",
            "--kv-transfer-config", ref, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']
    if "-pcp" not in layout:
        argv += ["--attention-config", '{"hisparse_config": {"host_pool_gib": 384}}']
    args = make_arg_parser().parse_args(argv)
    validate_args(args)
    assert OffloadConfig.from_dict(args.kv_transfer_config).cpu_bytes_to_use == 128 * GiB
    assert parallel_config(args).num_devices == 8


def test_served_host_tier_hit_counts_in_cached_tokens_and_metrics():
    """The reference flag on the real server (openai client): after the device prefix cache
    forgets a prompt (`PrefixCache.reset`), sending it again reports the host-tier hit in
    `cached_tokens` and in vLLM's external prefix-cache and kv_offload counters."""
    import json
    import time

    import httpx
    import openai

    from serving.run import build_server
    from tests.helpers.live_server import live_server
    from tests.serving.test_e2e_server import ARGV

    app, _, served = build_server(ARGV + ["--kv-transfer-config", json.dumps(offload_flag())])
    e = served.engine
    idx = indexer_page(e)
    try:
        with live_server(app) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            prompt = np.random.default_rng(3).integers(10, 490, 850).tolist()
            hit = (len(prompt) - 1) // idx * idx  # whole indexer pages (448 on the twin, 768 on the tiny checkpoint)
            assert 0 < hit < (len(prompt) - 1) // 64 * 64
            kw = dict(model="glm-5.3-tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                      extra_body={"ignore_eos": True})
            cold = client.completions.create(**kw)
            deadline = time.time() + 30
            while (e.offload.store.queue or e.offload.store.in_flight) and time.time() < deadline:
                time.sleep(0.05)
            assert e.prefix_cache.reset() > 0  # the device cache forgets the prompt
            warm = client.completions.create(**kw)
            assert warm.usage.prompt_tokens_details.cached_tokens == hit
            assert warm.choices[0].logprobs.tokens == cold.choices[0].logprobs.tokens
            text = httpx.get(base + "/metrics").text
            metric = {line.split("{")[0] + ("{" + line.split("{")[1].split("}")[0] + "}" if "transfer_type" in line
                                            else ""): float(line.rsplit(" ", 1)[1])
                      for line in text.splitlines() if line.startswith("vllm:")}
            assert metric["vllm:external_prefix_cache_hits_total"] == hit
            assert metric["vllm:external_prefix_cache_queries_total"] == 2 * 850
            out = next(v for k, v in metric.items() if k.startswith("vllm:kv_offload_total_bytes") and "gpu_to_cpu" in k)
            back = next(v for k, v in metric.items() if k.startswith("vllm:kv_offload_total_bytes") and "cpu_to_gpu" in k)
            page_bytes = e.offload.store.page_bytes
            assert out >= (len(prompt) // 64 + len(prompt) // idx) * page_bytes  # every full page of the prompt
            assert back == (hit // 64 + hit // idx) * page_bytes  # the hit's MLA and indexer pages
            assert metric["vllm:kv_offload_stores_skipped_total"] == 0  # the store has room
    finally:
        served.shutdown()
    assert e.audit() == []


def test_asynchronous_scheduling_with_the_connector_gives_the_synchronous_outputs(small):
    """`--async-scheduling` with the connector (serving/async_scheduling.py): stores are filed and
    loads released when their step is dispatched, ordered through the arena. Shared 800-token
    heads on a pool that cannot keep them, all at once: the asynchronous run loads pages back from
    the host and gives the synchronous run's tokens, with every audit clean after every step."""
    e = small
    rng = np.random.default_rng(3)
    heads = [rng.integers(10, 490, 800).tolist() for _ in range(3)]
    prompts = [heads[i % 3] + rng.integers(10, 490, 30 + 20 * (i % 3)).tolist() for i in range(8)]

    def run_all(tag):
        outs = {f"{tag}{i}": [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            e.add_request(f"{tag}{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        while e.has_unfinished_requests():
            for o in e.step():
                outs[o.request_id] += o.new_token_ids
            assert e.audit() == []
        return [outs[f"{tag}{i}"] for i in range(len(prompts))]

    sync = run_all("s")
    loaded = e.offload.store.num_loaded
    e.set_async_scheduling(True)
    try:
        asyn = run_all("a")
    finally:
        e.set_async_scheduling(False)
    assert asyn == sync
    assert e.offload.store.num_loaded > loaded  # the asynchronous run read host blocks back
    assert_clean(e)


def test_a_full_host_store_skips_stores_counts_them_on_metrics_and_warns_once(caplog):
    """A store with no free host block is skipped: counted (`num_skipped`), warned about once
    naming the flag that sizes the store, and exported as vllm:kv_offload_stores_skipped_total
    (the counter an operator reads to see that the store is too small)."""
    import logging

    from serving.metrics import EngineGauges, PrometheusStatLogger, StepRecord
    from serving.offload.store import OffloadStore

    st = OffloadStore(4, ("mla",), page_bytes=100)
    with caplog.at_level(logging.WARNING, logger="serving.offload.store"):
        queued = [st.queue_store("mla", bytes([i]), 10 + i) for i in range(st.num_usable + 3)]
    assert queued == [True] * st.num_usable + [False] * 3 and st.num_skipped == 3
    assert [r.getMessage() for r in caplog.records if "cpu_bytes_to_use" in r.getMessage()] != []
    assert len(caplog.records) == 1  # once, not per skipped page
    assert not st.queue_store("mla", bytes([0]), 99) and st.num_skipped == 3  # queued already: not a skip
    logger = PrometheusStatLogger("m", EngineGauges(lambda: 0, lambda: 0, lambda: 0.0, offload=st.usage))
    logger.record(StepRecord(kv_offload_stores_skipped=st.num_skipped))
    assert 'vllm:kv_offload_stores_skipped_total{model_name="m"} 3.0' in logger.render().decode()
