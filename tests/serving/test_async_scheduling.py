"""Asynchronous scheduling (`serving/async_scheduling.py`) against the synchronous engine.

One engine (the embedded tiny checkpoint, prefix caching on, a pool small enough that a batch of
32 preempts) runs every workload twice, synchronously and then with `set_async_scheduling(True)`
(the same compiled steps): greedy and seeded-sampled streams, logprobs, finish reasons and
stop-token / `max_tokens` stops mid-batch must be equal; the pool and the scheduler are audited
after every step; nothing is left allocated at the end. Asynchronous-only rules: a request that
stops (or is aborted) while the next step is in flight never streams another token, and a step
that fails fails its own requests while the step before it is still delivered.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.faults import FaultInjection
from serving.metrics import PrometheusStatLogger, StepRecord
from serving.types import SamplingParams
from tests.helpers.engine_drive import drive

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

MAX_NUM_SEQS = 32


class Recorder:
    """A stat logger that keeps every `StepRecord`."""

    def __init__(self):
        self.records: list[StepRecord] = []

    def record(self, rec: StepRecord) -> None:
        self.records.append(rec)


@pytest.fixture(scope="module")
def engine():
    # Buckets 8, 32 and the 128-token budget; 36 pages (35 usable; a request takes one per 64
    # tokens in the `mla` group and one per 448 in the `indexer` group, on the 7-layer twin).
    e = build_engine(EngineArgs(max_model_len=512, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=128,
                                cuda_graph_sizes=[8, 32], precompile_token_paddings=[], num_gpu_blocks_override=36,
                                enable_prefix_caching=True, compile_progress=False, disable_log_stats=True,
                                skip_precompile=False))  # compiled at start-up, as a server's (checked below)
    e.stat_loggers.append(PrometheusStatLogger("tiny", e.gauges))
    e.stat_loggers.append(Recorder())
    programs = e.runner._step._cache_size()  # jit's own count of compiled signatures
    yield e
    # Steps fed on the device hit the programs compiled at start-up: none was compiled again.
    assert e.runner._step._cache_size() == programs
    assert not e.has_unfinished_requests() and e.audit() == []
    assert e.pool.num_free == e.pool.num_usable_blocks, "KV pages leaked"


def workload(batch: int, seed: int, stops: dict | None = None):
    rng = np.random.default_rng(seed)
    reqs = {}
    for i in range(batch):
        n = int(rng.integers(8, 160))  # prompts past the 128-token budget prefill in chunks
        prompt = rng.integers(10, 490, n).tolist()
        kw = {"max_tokens": int(rng.integers(1, 32 if i % 3 else 12)), "ignore_eos": bool(i % 3),
              "logprobs": 2 if i % 4 == 0 else None}
        if i % 2:
            kw.update(temperature=1.0, top_p=0.9, seed=1000 + i)
        else:
            kw.update(temperature=0.0)
        if stops and f"r{i}" in stops:
            kw["stop_token_ids"] = [stops[f"r{i}"]]
        reqs[f"r{i}"] = (prompt, SamplingParams(**kw))
    return reqs


def assert_same(a, b):
    toks_a, reasons_a, lps_a, _ = a
    toks_b, reasons_b, lps_b, _ = b
    assert toks_a == toks_b
    assert reasons_a == reasons_b
    for rid in lps_a:
        assert [x.token_id for x in lps_a[rid]] == [x.token_id for x in lps_b[rid]]
        np.testing.assert_allclose([x.logprob for x in lps_a[rid]], [x.logprob for x in lps_b[rid]], atol=1e-5)


@pytest.mark.parametrize("batch", [1, 32])
def test_streams_equal_the_synchronous_engine(engine, batch):
    """Greedy and seeded-sampled streams, logprobs, chunked prefill, max_tokens and stop tokens
    mid-batch. The asynchronous run gets a stop
    token on every eighth request (the third token the synchronous run emitted for it): its
    stream must be the synchronous one cut after that token's first occurrence."""
    e = engine
    free = e.pool.num_free
    sync = drive(e, workload(batch, batch), False)
    stops = {rid: t[2] for rid, t in sync[0].items() if len(t) > 4 and int(rid[1:]) % 8 == 1}
    assert stops or batch == 1
    rec = e.stat_loggers[-1]
    n_rec = len(rec.records)
    asyn = drive(e, workload(batch, batch, stops), True)
    toks, reasons, lps, _ = sync
    for rid, stop in stops.items():
        cut = toks[rid].index(stop) + 1
        toks[rid], lps[rid], reasons[rid] = toks[rid][:cut], lps[rid][:cut], "stop"
    assert_same((toks, reasons, lps, 0), asyn)
    # The statistics count what was streamed (not the extra token of a stopped request).
    generated = sum(r.num_generation_tokens for r in rec.records[n_rec:])
    assert generated == sum(len(t) for t in asyn[0].values())
    steps = [r for r in rec.records[n_rec:] if r.is_step]
    assert steps and all(r.host_s >= 0 for r in steps)
    prom = e.stat_loggers[-2]
    assert f"vllm:step_exposed_host_seconds_count{{model_name=\"tiny\"}} {float(len(rec.records) - sum(
        not r.is_step for r in rec.records))}" in prom.render().decode()
    assert e.pool.num_free == free == e.pool.num_usable_blocks  # cached pages count as free


def test_preemption_while_a_step_is_in_flight(engine):
    """Twelve requests of 100 tokens (two 64-token pages of the `mla` group and one 448-token page
    of the `indexer` group each) fill the 35-page pool as they are admitted; growing past 128
    tokens they need a third `mla` page, so the pool preempts, in both runs. With asynchronous
    scheduling a request preempted while the step in flight samples its next token drops that
    token and recomputes it after resuming: the same streams."""
    e = engine
    rng = np.random.default_rng(5)
    reqs = {f"p{i}": (rng.integers(10, 490, 100).tolist(),
                      SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=40, ignore_eos=True))
            for i in range(12)}
    n0 = e.scheduler.num_preemptions_total
    sync = drive(e, reqs, False)
    n1 = e.scheduler.num_preemptions_total
    asyn = drive(e, reqs, True)
    assert n1 > n0 and e.scheduler.num_preemptions_total > n1
    assert_same(sync, asyn)


def test_prefix_cache_hits_and_copy_on_write_while_a_step_is_in_flight(engine):
    """Follow-up requests that share a 200-token prefix with a request still decoding arrive while
    a step is in flight: they hit the prefix cache (whole `mla` pages shared, the `indexer` page the
    hit ends inside copied on write on the device) and stream what the synchronous engine streams."""
    e = engine
    rng = np.random.default_rng(9)
    base = rng.integers(10, 490, 200).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reqs = {"base": (base, greedy)}
    for i in range(4):
        reqs[f"follow{i}"] = (base[: 150 + 10 * i] + rng.integers(10, 490, 30).tolist(),
                              SamplingParams(temperature=0.7, seed=i, max_tokens=8, ignore_eos=True))
    events = {0: [("add", "base")], 4: [("add", "follow0"), ("add", "follow1")], 6: [("add", "follow2")],
              7: [("add", "follow3")]}
    results = []
    for async_scheduling in (False, True):
        e.prefix_cache.reset()  # both runs start from a cold cache
        copies, hits = e.runner.num_page_copies, e.prefix_cache.hits
        results.append(drive(e, reqs, async_scheduling, events))
        assert e.runner.num_page_copies > copies and e.prefix_cache.hits - hits >= 4 * 128
    assert_same(*results)


def test_abort_while_the_next_step_is_in_flight(engine):
    """A request aborted after `step()` returned (its next step already dispatched) never streams
    again, its pages go back, and the others' streams equal the synchronous run's."""
    e = engine
    reqs = workload(6, 7)
    reqs = {rid: (p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)) for rid, (p, _) in reqs.items()}
    sync = drive(e, reqs, False)
    events = {0: [("add", rid) for rid in reqs], 6: [("abort", "r1")], 9: [("abort", "r4")]}
    asyn = drive(e, reqs, True, events)
    for rid in reqs:
        if rid in ("r1", "r4"):
            assert asyn[1][rid] == "abort"
            assert asyn[0][rid] == sync[0][rid][: len(asyn[0][rid])]
        else:
            assert asyn[0][rid] == sync[0][rid] and asyn[1][rid] == "length"
    assert not e.kv.has_request("r1") and not e.kv.has_request("r4")


def test_a_failed_step_fails_its_requests_and_the_step_before_is_delivered(engine):
    e = engine
    reqs = {f"f{i}": (list(range(20 + i, 60 + i)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            for i in range(3)}
    sync = drive(e, reqs, False)
    e.set_async_scheduling(True)
    for rid, (p, sp) in reqs.items():
        e.add_request(rid, p, sp)
    toks = {rid: [] for rid in reqs}
    for _ in range(4):
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
    before = {rid: list(t) for rid, t in toks.items()}
    e.runner.faults = FaultInjection("step_error")  # the next dispatch raises
    outs = e.step()
    e.runner.faults = None
    errors = [o for o in outs if o.finish_reason == "error"]
    assert {o.request_id for o in errors} == set(reqs)
    for o in outs:  # the step in flight was read back and applied first
        toks[o.request_id] += o.new_token_ids
    for rid in reqs:
        assert len(toks[rid]) == len(before[rid]) + 1 and toks[rid] == sync[0][rid][: len(toks[rid])]
    assert not e.has_unfinished_requests() and e.audit() == []
    assert not e.runner.device_state_lost()
    assert drive(e, reqs, True)[0] == sync[0]  # and the engine goes on


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_stops_and_aborts(engine, data):
    """A randomized workload of arrivals (at random `step()` calls), stop tokens, max_tokens and
    aborts: requests never aborted stream what the synchronous engine streams; an aborted request's
    stream is a prefix of the other run's stream for it (the two runs abort it at the same call,
    which is one step later in the asynchronous run's tokens)."""
    e = engine
    n = data.draw(st.integers(1, 6), label="requests")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    reqs = workload(n, seed, stops={f"r{i}": data.draw(st.integers(10, 490)) for i in range(n)})
    events: dict[int, list] = {}
    for rid in reqs:
        events.setdefault(data.draw(st.integers(0, 8), label=f"arrival {rid}"), []).append(("add", rid))
        if data.draw(st.booleans(), label=f"abort {rid}?"):
            events.setdefault(data.draw(st.integers(1, 14), label=f"abort {rid} at"), []).append(("abort", rid))
    # An abort scheduled before the arrival is dropped (the request is unknown then).
    events = {k: [ev for ev in v if ev[0] == "add" or any(
        a == ("add", ev[1]) for kk, vv in events.items() if kk < k for a in vv)] for k, v in events.items()}
    aborted = {rid for v in events.values() for kind, rid in v if kind == "abort"}
    # The prefix cache first holds what both runs will find in it (else the second run hits the
    # first run's pages and is batched differently, and a seeded temperature-1 draw can flip on
    # the last bits that batching moves: docs/async_scheduling.md).
    drive(e, reqs, False, events)
    sync = drive(e, reqs, False, events)
    asyn = drive(e, reqs, True, events)
    for rid in reqs:
        a, s = asyn[0][rid], sync[0][rid]
        if rid in aborted:
            assert a == s[: len(a)] or s == a[: len(s)]
        else:
            assert a == s and asyn[1][rid] == sync[1][rid]
