"""Asynchronous scheduling under MTP speculation on a parallel layout (`serving.spec_decode.feed`):
DP2 × PCP2 × DCP2 (4 simulated devices) stacks two replicas' steps, places each replica's tokens in
PCP's load-balanced order and maps engine pages of 2 × 64 tokens over the DCP ranks, so the feed's
rows, request rows and slots must follow all three. The trained `tiny-recall` checkpoint on copy
prompts (drafts accepted 0 … k times from step to step); the synchronous run of the same engine is
the independent result: greedy and seeded streams, finish reasons and logprobs equal, audits
clean after every step, nothing left allocated.

Also Hybrid HiSparse under DP2 × TP2 × DCP2 (8 simulated devices): a host pool, policy and hot
state per replica, each DCP rank resolving its share of the fed verification rows through its
hot lease.
"""

from __future__ import annotations

import pytest

from serving.types import SamplingParams
from sharding.mesh import ParallelConfig
from tests.helpers.mtp_async import (
    assert_same,
    copy_conversations,
    copy_prompts,
    drive,
    mtp_engine,
)


@pytest.fixture(scope="module")
def prompts():
    return copy_prompts(6)


@pytest.fixture(scope="module")
def engine():
    par = ParallelConfig(data_parallel_size=2, prefill_context_parallel_size=2, decode_context_parallel_size=2)
    e = mtp_engine(parallel=par)
    yield e
    assert not e.has_unfinished_requests() and e.audit() == []


def test_dp2_pcp2_dcp2_streams_equal_the_synchronous_engine(engine, prompts):
    reqs = {}
    for i, p in enumerate(prompts):
        sp = {"temperature": 0} if i % 2 == 0 else {"temperature": 2.0, "seed": 200 + i}
        reqs[f"p{i}"] = (p, SamplingParams(max_tokens=[40, 3, 40, 7, 25, 40][i], ignore_eos=True, logprobs=2, **sp))
    sync = drive(engine, reqs, False)
    asyn = drive(engine, reqs, True)  # (it checks that no step program was compiled for the fed steps)
    assert_same(sync, asyn)
    assert len(asyn[3]) > 5 and sum(asyn[3]) > 2 * len(asyn[3])
    assert engine.spec_stats.num_accepted_tokens > 0
    print(f"\nfed steps {len(asyn[3])}, drafts verified in them {sum(asyn[3])}")


def test_hybrid_hisparse_dp2_tp2_dcp2_streams_equal_the_synchronous_engine():
    """Four copy conversations of 1,000–1,300 tokens on 16-page pools per replica (engine pages of
    2 × 64 tokens; one request fully resident takes 13): the replicas release clean pages to their
    host pools and verify the fed rows through hot leases of the minimum (k + 1) × index_topk rows
    (4 pages), whose positions the step in flight's accepted counts moved on the device. Streams,
    finish reasons and logprobs equal the synchronous run's; nobody preempted; nothing left on the
    device or in the host pools. (DP2 × PCP2 × DCP2 with HiSparse is not used here: XLA:CPU's
    simulated devices may run its hot program's independent collectives — a reduce-scatter within
    each DCP pair, an all-gather over all four devices — in different orders and deadlock while the
    engine compiles, docs/test_suite.md.)"""
    from tests.helpers.hisparse_pool import replicas

    par = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, decode_context_parallel_size=2)
    e = mtp_engine(parallel=par, max_model_len=1600, num_gpu_blocks_override=16, enable_prefix_caching=False,
                   attention_config={"hisparse_config": {"host_pool_gib": 0.05, "device_buffer_size": 256}})
    prompts = copy_conversations([14, 16, 12, 15])
    reqs = {f"h{i}": (p, SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2,
                                        **({"temperature": 2.0, "seed": 7} if i == 2 else {"temperature": 0})))
            for i, p in enumerate(prompts)}
    policies = e.hisparse.policies
    released0 = sum(p.num_released for p in policies)
    sync = drive(e, reqs, False)
    released1 = sum(p.num_released for p in policies)
    hot_fed = []
    asyn = drive(e, reqs, True, hot_fed=hot_fed)
    assert_same(sync, asyn)
    print(f"\nreleased {released1 - released0} / {sum(p.num_released for p in policies) - released1} (sync / async); "
          f"fed steps {len(asyn[3])}, on the hot program {sum(hot_fed)}")
    assert released1 > released0 and sum(p.num_released for p in policies) > released1
    assert sum(hot_fed) > 10 and sum(asyn[3]) > len(asyn[3])  # fed rows verified drafts through hot leases
    assert sum(s.num_preemptions_total for s in e._schedulers()) == 0
    assert e.hisparse.device.drops_outside_truncation == 0
    for kv, pol in replicas(e):
        assert kv.pool.num_free == kv.pool.num_usable_blocks and pol.host.blocks.num_free == pol.host.num_usable
