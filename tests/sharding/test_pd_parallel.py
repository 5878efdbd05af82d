"""P/D across parallel layouts (8 simulated devices, engines sharing them): a PCP2 × DCP2 prefill
engine hands its token-sharded KV to a DP2 decode engine (each replica needs whole pages of its
own) and to a TP2 × DCP2 decode engine with another interleave (DCP 2 → 2, rows re-dealt).
Greedy streams must equal the single-device colocated run; both sides audit clean."""

from __future__ import annotations

import pytest

from glm53.equality import compare_streams
from sharding.mesh import ParallelConfig
from tests.serving.test_pd_engine import PROMPTS, build, connector, decode_all, prefill_all, reference  # noqa: F401

PCP2_DCP2 = ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2)


@pytest.fixture(scope="module")
def prefill():
    return build(connector("kv_producer"), parallel=PCP2_DCP2)


@pytest.mark.parametrize("decode_parallel", [
    ParallelConfig(data_parallel_size=2, enable_expert_parallel=True),
    ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_kv_cache_interleave_size=2),
], ids=["dp2", "tp2xdcp2-i2"])
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
    if decode_parallel.data_parallel_size == 2:  # both replicas took requests
        assert decode.pd.consumer.num_transfers == len(PROMPTS)
