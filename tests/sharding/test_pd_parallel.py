"""P/D across parallel layouts (8 simulated devices, engines sharing them): a PCP2 × DCP2 prefill
engine hands its token-sharded KV to a TP2 decode engine (DCP 2 → 1: every page whole), to a
TP2 × DCP2 decode engine with another interleave (DCP 2 → 2, rows re-dealt), and to a DP2 Hybrid
HiSparse decode engine whose pools are far too small (host landing); and the reference's two
layouts with MTP speculation on both sides (PCP2 × DCP2 → DP2 + EP). Greedy streams must equal
the single-device colocated run; both sides audit clean."""

from __future__ import annotations

import pytest

from glm53.equality import compare_streams
from sharding.mesh import ParallelConfig
from tests.serving.test_pd_engine import PROMPTS, build, connector, decode_all, prefill_all, reference  # noqa: F401

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

PCP2_DCP2 = ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2)


@pytest.fixture(scope="module")
def prefill():
    return build(connector("kv_producer"), parallel=PCP2_DCP2)


@pytest.mark.parametrize("decode_parallel", [
    ParallelConfig(tensor_parallel_size=2),
    ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_kv_cache_interleave_size=2),
], ids=["tp2-dcp1", "tp2xdcp2-i2"])
def test_pcp2_dcp2_prefill_to_parallel_decode(prefill, reference, decode_parallel):
    decode = build(connector("kv_consumer"), parallel=decode_parallel)
    params = prefill_all(prefill, PROMPTS)
    streams, outs = decode_all(prefill, decode, PROMPTS, params)
    ref, ref_lp = reference
    compare_streams(ref, streams, ref_lp, PROMPTS)
    for rid, p in PROMPTS.items():
        assert outs[rid].num_cached_tokens == len(p) - 1
    prefill.step()
    assert prefill.pd.producer.held == {} and not prefill.audit() and not decode.audit()
    assert decode.pd.consumer.num_transfers == len(PROMPTS)


LONG = {"x": [(7 * i) % 300 + 4 for i in range(600)], "y": [(11 * i) % 350 + 4 for i in range(520)],
        "z": [(13 * i) % 400 + 4 for i in range(450)], "w": [(17 * i) % 420 + 4 for i in range(380)]}


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp2"])
def test_pcp2_dcp2_prefill_to_dp2_hisparse_decode_lands_in_the_host_pool(monkeypatch, mtp):
    """The reference decode layout, scaled: DP2 replicas with Hybrid HiSparse on a device pool far
    too small for the prompts (9 usable pages per replica; the longest prompt needs 11). What does not fit lands straight in the
    replica's host pool; nobody is preempted; the hot buffer really reads host rows; streams equal
    the colocated single-device run. Both engines schedule asynchronously (as the server does by
    default): host landings and page writes go before the step they feed; the synchronous
    landing is tested in tests/serving/test_pd_engine.py. Both engines take the per-process path
    of a multi-process engine (serving/pd/shards.py: each replica's pages read from its own
    shards, landing plans, the sharded page scatter; the other tests here take the one-process
    path), which tests/sharding/test_multihost.py runs across processes without HiSparse.
    `mtp2`: both engines with MTP k = 2, as the reference runs them (its decode engine: HiSparse +
    MTP, now asynchronous too): the MTP layer's rows land with the rest, in the host pool or on the
    device, and the decode steps verify drafts through hot leases of (k + 2) × index_topk rows (one
    page more in the pool for the larger lease; the prefill lease at least the decode lease)."""
    from serving.pd.shards import PER_PROCESS_ENV
    from tests.serving.test_pd_engine import _colocated

    monkeypatch.setenv(PER_PROCESS_ENV, "1")
    _, ref, ref_lp = _colocated(LONG, max_model_len=1024, num_gpu_blocks_override=96)
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}} if mtp else {}
    prefill = build(connector("kv_producer"), parallel=PCP2_DCP2, max_model_len=1024, num_gpu_blocks_override=96,
                    async_scheduling=True, **spec)
    decode = build(connector("kv_consumer"), parallel=ParallelConfig(data_parallel_size=2, enable_expert_parallel=True),
                   max_model_len=1024, num_gpu_blocks_override=11 if mtp else 10, async_scheduling=True,
                   attention_config={"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 256 if mtp else 128}},
                   **spec)
    assert prefill.async_scheduling and decode.async_scheduling
    params = prefill_all(prefill, LONG)
    streams, outs = decode_all(prefill, decode, LONG, params)
    compare_streams(ref, streams, ref_lp, LONG)
    c = decode.pd.consumer
    print(f"\nlanded on the device {c.num_landed_device}, in the host pool {c.num_landed_host}; hot misses "
          f"{decode.hisparse.device.misses}")
    assert c.num_landed_host >= 2 and c.num_landed_device + c.num_landed_host == len(LONG)
    assert prefill.pd_process.num_staged == len(LONG) and decode.pd_process.num_pulled == len(LONG)
    assert decode.pd_process.pulled == {}  # every pulled request's rows landed and were forgotten
    assert sum(r.scheduler.num_preemptions_total for r in decode.replicas) == 0
    assert decode.hisparse.device.misses > 0
    if mtp:
        print(f"drafts {decode.spec_stats.num_draft_tokens}, accepted {decode.spec_stats.num_accepted_tokens}")
        assert decode.spec_stats.num_draft_tokens > 0
    assert not decode.audit() and all(r.pool.num_free == r.pool.num_usable_blocks for r in decode.replicas)
    assert all(h.blocks.num_free == h.num_usable for h in decode.hisparse.hosts)  # no leaked host block


def test_dp2_decode_keeps_a_conversation_on_the_replica_holding_it():
    """Prefix-aware replica choice: each conversation's later turn goes to the replica whose prefix
    cache holds its earlier turn (and pulls only the rest); `data_parallel_rank` (vLLM's X-data-parallel-rank) pins a request."""
    from serving.types import SamplingParams

    kw = dict(max_model_len=1024, num_gpu_blocks_override=96, enable_prefix_caching=True)
    prefill = build(connector("kv_producer"), **kw)
    decode = build(connector("kv_consumer"), parallel=ParallelConfig(data_parallel_size=2, enable_expert_parallel=True),
                   **kw)
    convs = {"u": [(7 * i) % 300 + 4 for i in range(900)], "v": [(11 * i) % 350 + 4 for i in range(900)]}
    where = {}
    orig = decode._queue

    def spy(req):
        orig(req)
        where[req.request_id] = decode.replica_of(req.request_id).index

    decode._queue = spy
    streams, _ = decode_all(prefill, decode, convs, prefill_all(prefill, convs), max_tokens=4)
    assert sorted(where.values()) == [0, 1]
    turn2 = {f"{k}2": p + streams[k] + [(5 * i) % 200 + 4 for i in range(30)] for k, p in convs.items()}
    before = decode.pd.consumer.bytes_transferred
    decode_all(prefill, decode, turn2, prefill_all(prefill, turn2), max_tokens=4)
    for k in convs:
        assert where[f"{k}2"] == where[k], f"{k}: turn 2 went to replica {where[f'{k}2']}, turn 1 was on {where[k]}"
    assert decode.pd.consumer.bytes_transferred - before < 0.4 * before  # only the new tokens' pages moved
    pinned = {"p": [(3 * i) % 100 + 4 for i in range(50)]}
    params = prefill_all(prefill, pinned)
    decode.add_request("p", pinned["p"], SamplingParams(temperature=0.0, max_tokens=2, data_parallel_rank=1,
                                                        kv_transfer_params=params["p"]))
    while decode.has_unfinished_requests():
        prefill.step()
        decode.step()
    assert where["p"] == 1
    with pytest.raises(ValueError, match="X-data-parallel-rank"):
        decode.add_request("bad", pinned["p"], SamplingParams(max_tokens=2, data_parallel_rank=2))
    assert not decode.audit() and not prefill.audit()


def test_pcp2_dcp2_prefill_with_cpu_offload_serves_a_later_turn_from_host_memory():
    """The reference prefill engine's second half: PCP2 × DCP2 with the CPU KV offload (a
    MultiConnector with the P/D connector). Every DCP rank offloads its share of each page; a
    later turn whose pages another request pushed off the device pool (13 pages) comes back from
    host memory on both ranks, and the decode engine's stream equals the colocated run."""
    from tests.serving.test_pd_engine import _colocated

    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "JaxTransferConnector", "kv_role": "kv_producer"},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"cpu_bytes_to_use": 256 * 2**20}}]}}
    kw = dict(max_model_len=2048, enable_prefix_caching=True)
    prefill = build(multi, parallel=PCP2_DCP2, num_gpu_blocks_override=14, **kw)
    assert prefill.offload is not None and prefill.pd is not None
    decode = build(connector("kv_consumer"), num_gpu_blocks_override=96, **kw)
    turn1 = [(7 * i) % 300 + 4 for i in range(900)]
    streams, _ = decode_all(prefill, decode, {"t1": turn1}, prefill_all(prefill, {"t1": turn1}))
    other = [(11 * i) % 350 + 4 for i in range(1200)]  # pushes turn 1's pages off the prefill device
    decode_all(prefill, decode, {"o": other}, prefill_all(prefill, {"o": other}))
    turn2 = turn1 + streams["t1"] + [(5 * i) % 200 + 4 for i in range(40)]
    ext = prefill.prefix_cache.external_hits
    params = prefill_all(prefill, {"t2": turn2})
    assert prefill.prefix_cache.external_hits > ext  # from the offload tier, on both DCP ranks
    got, _ = decode_all(prefill, decode, {"t2": turn2}, params)
    _, ref, ref_lp = _colocated({"t2": turn2}, num_gpu_blocks_override=96, **kw)
    compare_streams(ref, got, ref_lp, {"t2": turn2})
    prefill.step()
    assert not prefill.audit() and not decode.audit()


def test_reference_layouts_with_mtp_on_both_sides():
    """The reference deployment's two engines, scaled, both with MTP speculation (k = 2; the
    reference runs MTP3 on both): a PCP2 × DCP2 prefill engine (the MTP layer's rows written in
    the load-balanced token order and token-sharded like every other layer's) hands its KV to a
    DP2 + EP decode engine (each replica lands its requests' MTP rows with the rest and verifies
    their drafts). Greedy streams equal the colocated single-device MTP run's, and every
    request's drafts after every decode step equal the colocated run's (they are computed from
    the pulled MTP rows)."""
    from tests.helpers.drafts import record_drafts
    from tests.serving.test_pd_engine import _colocated

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    want: dict = {}
    _, ref, ref_lp = _colocated(PROMPTS, setup=lambda e: record_drafts(e, into=want), speculative_config=spec)
    prefill = build(connector("kv_producer"), parallel=PCP2_DCP2, speculative_config=spec)
    decode = build(connector("kv_consumer"), parallel=ParallelConfig(data_parallel_size=2, enable_expert_parallel=True),
                   speculative_config=spec)
    got = record_drafts(decode)
    params = prefill_all(prefill, PROMPTS)
    streams, _ = decode_all(prefill, decode, PROMPTS, params)
    compare_streams(ref, streams, ref_lp, PROMPTS)
    assert decode.placements.placed == [2, 1]
    assert got == want and decode.spec_stats.num_draft_tokens > 0
    prefill.step()
    assert prefill.pd.producer.held == {} and not prefill.audit() and not decode.audit()
    assert all(r.pool.num_free == r.pool.num_usable_blocks for r in decode.replicas)
