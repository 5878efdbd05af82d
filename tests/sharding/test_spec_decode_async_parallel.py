"""Asynchronous scheduling under MTP speculation on a parallel layout (`serving.spec_decode.feed`):
DP2 × PCP2 × DCP2 (4 simulated devices) stacks two replicas' steps, places each replica's tokens in
PCP's load-balanced order and maps engine pages of 2 × 64 tokens over the DCP ranks, so the feed's
rows, request rows and slots must follow all three. The trained `tiny-recall` checkpoint on copy
prompts (drafts accepted 0 … k times from step to step); the synchronous run of the same engine is
the independent result: greedy and seeded streams, finish reasons and logprobs equal, audits
clean after every step, nothing left allocated.
"""

from __future__ import annotations

import pytest

from serving.types import SamplingParams
from sharding.mesh import ParallelConfig
from tests.helpers.mtp_async import assert_same, copy_prompts, drive, mtp_engine


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
