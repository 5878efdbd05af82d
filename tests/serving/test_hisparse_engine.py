"""Hybrid HiSparse in the real engine (tiny checkpoint, CPU): under KV pressure every request keeps
decoding with nobody preempted, and the greedy streams equal those of a run whose device pool is
large enough for everything (docs/design.md §10's equality rule) — on a multi-turn workload whose contexts are many times index_topk
(the fp8 cache under HiSparse: tests/sharding/test_multihost.py); a request of about three times the device pool's token capacity is served; clean
pages in the host pool equal their device copies byte for byte; the compiled step reads host memory
only through slices and memory-kind moves; aborts free everything in every residency state."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from glm53 import api
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.types import SamplingParams
from tests.helpers.conversations import run_conversations, user_tokens
from tests.helpers.hisparse_pool import check_host_pool_bytes
from glm53.equality import compare_streams
from tests.helpers.host_memory import host_memory_reads

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

# A multi-turn workload: 3 conversations x 3 turns, first turn 950 tokens (15x index_topk = 64),
# 24 new user tokens and 12 output tokens per turn. A first turn needs 15 MLA + 2 indexer pages: the
# small pool (35 usable pages) admits two of them, which then cannot both grow (a preemption
# engine preempts); the ample pool holds everything.
CONV = dict(conversations=3, turns=3, first_tokens=950, new_tokens=24, max_tokens=12)
SMALL, AMPLE = 36, 160
# The ample engines take the 3×-pool test's prompt too: one ample engine (one compile) serves every
# test of this module (tests/serving/test_offload.py builds the same engine).
AMPLE_MAX_MODEL_LEN = 4700
HISPARSE = {"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 1024}}


def engine(num_blocks, kv_cache_dtype, attention_config=None, max_model_len=2048, **kw):
    # One step bucket (64 tokens): a second one (16) is one more plain and one more hot program to
    # compile per engine, which costs more than padding the small steps does on the CPU (measured
    # in docs/test_suite.md). Also the engine of tests/serving/test_offload.py and of the HiSparse
    # and offloading tests of tests/serving/test_spec_decode.py.
    args = EngineArgs(max_model_len=max_model_len, max_num_seqs=4, max_num_batched_tokens=64, cuda_graph_sizes=[], precompile_token_paddings=[],
                      num_gpu_blocks_override=num_blocks, kv_cache_dtype=kv_cache_dtype, compile_progress=False,
                      disable_log_stats=True, enable_prefix_caching=True, attention_config=attention_config, **kw)
    return build_engine(args)


def mean_running(run):
    nz = [r for r in run.running if r]
    return sum(nz) / len(nz)


@pytest.fixture(scope="module")
def bf16_ample():
    """The ample bf16 engine without HiSparse, shared by the tests of this module (one compile)."""
    return engine(AMPLE, "bfloat16", max_model_len=AMPLE_MAX_MODEL_LEN)


def test_multiturn_streams_match_the_ample_run_and_nobody_is_preempted(bf16_ample):
    """On the bf16 cache; the fp8 cache's rows go through the host pool and the hot buffer in
    tests/sharding/test_multihost.py's HiSparse engine (two processes, streams equal the one-device
    ample fp8 run) and tests/kernels/test_host_rows.py (byte-exact copies of fp8 rows). The
    pressure is real: two first turns need more pages than the small pool has once they grow (a
    preemption engine preempts there: `scripts/bench_agentic.py`'s baseline; preemption's own
    streams are checked in tests/serving/test_async_scheduling.py), so HiSparse runs them both
    only by releasing pages to the host pool."""
    lm = api.load(cache_dtype="bfloat16")
    ample = run_conversations(bf16_ample, logprobs=2, **CONV)
    hs_engine = engine(SMALL, "bfloat16", HISPARSE)  # (its own: the tests below start from an empty engine)
    hs = run_conversations(hs_engine, **CONV)
    d = hs_engine.hisparse.device
    released = hs_engine.hisparse.policy.num_released
    print(f"\nmean running ample {mean_running(ample):.2f}, hisparse {mean_running(hs):.2f}; hot hits "
          f"{d.hits}, misses {d.misses}, {d.h2d_bytes} B host->device, {released} pages released")
    compare_streams(ample.outputs, hs.outputs, ample.logprobs, ample.prompts, lm)
    # Two 950-token first turns (15 MLA + 2 indexer pages each, growing) ran side by side in a
    # 35-page pool with 3 conversations' prefixes cached: pages went to the host pool.
    assert max(hs.running) >= 2 and released > 0
    assert hs_engine.scheduler.num_preemptions_total == 0
    assert d.misses > 0 and d.drops_outside_truncation == 0  # rows really came from the host pool
    assert hs_engine.prefix_cache.host_hits > 0  # later turns reused their prefix from the host tier
    assert hs_engine.pool.num_free == hs_engine.pool.num_usable_blocks
    assert hs_engine.hisparse.host.blocks.num_free == hs_engine.hisparse.host.num_usable  # no leaked host page


@pytest.fixture(scope="module")
def bf16_hisparse():
    return engine(SMALL, "bfloat16", HISPARSE)


def test_clean_pages_in_the_host_pool_equal_their_device_copies(bf16_hisparse):
    e = bf16_hisparse
    rng = np.random.default_rng(5)
    for i in range(2):
        e.add_request(f"clean{i}", rng.integers(10, 490, 700).tolist(),
                      SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    checked = 0
    for _ in range(60):  # prefill, then decode steps that seal and copy more pages
        e.step()
        checked += check_host_pool_bytes(e)
    while e.has_unfinished_requests():
        e.step()
    assert checked > 20
    assert e.audit() == []


def test_the_compiled_programs_read_host_memory_only_through_slices_and_moves(bf16_hisparse):
    """The step reads the host pool (missed rows: a slice moved to device memory); the store
    program writes it (a page moved to host memory, then `dynamic_update_slice`). Nothing else
    touches a host value: on a GPU anything else is refused or becomes slow host compute."""
    r = bf16_hisparse.runner
    batch, extra = r._dummy(r.buckets[0])
    step = host_memory_reads(jax.make_jaxpr(r._step)(r._state_leaves, r._place(batch), r.kv_arena, *extra,
                                                     r._hisparse_args()))
    src, dst = r.hisparse.store_lists([])
    store = host_memory_reads(jax.make_jaxpr(r._store_only)(r.hisparse.pool, r.kv_arena, src, dst))
    assert [x for x in step + store if x[1] != "ok"] == []
    assert {"dynamic_slice", "device_put"} <= {name for name, _ in step}
    assert "dynamic_update_slice" in {name for name, _ in store}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_aborts_free_every_page_in_every_residency_state(bf16_hisparse, async_scheduling):
    """Also with asynchronous scheduling (serving/async_scheduling.py), where an abort can hit a
    request whose next step is already in flight."""
    e = bf16_hisparse
    rng = np.random.default_rng(6)
    seen = set()
    e.set_async_scheduling(async_scheduling)
    for i in range(4):
        e.add_request(f"ab{i}", rng.integers(10, 490, 900).tolist(),
                      SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    step = 0
    try:
        while e.has_unfinished_requests():
            e.step()
            step += 1
            running = list(e.scheduler.running)
            for req in running:
                seen.add(e.hisparse.policy.residency(req))
            if step in (3, 20, 40, 60) and running:  # prefilling, then decoding requests
                e.abort(running[-1].request_id)
            if step == 70:
                for req in list(e.scheduler.running) + list(e.scheduler.waiting):
                    e.abort(req.request_id)
            assert e.audit() == []
        e.step()  # idle: nothing left; pending copies flushed
    finally:
        while e.has_unfinished_requests():
            e.step()
        e.set_async_scheduling(False)
    assert {"full", "mixed"} <= seen
    assert e.pool.num_free == e.pool.num_usable_blocks
    assert e.hisparse.host.blocks.num_free == e.hisparse.host.num_usable and not e.hisparse.host.queue


# A 25-page HiSparse engine with lease growth and asynchronous scheduling (one compile for the
# 3×-pool request and the squeezed leases below).
SMALL25 = {"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 640, "prefill_buffer_max_size": 1536}}


@pytest.fixture(scope="module")
def bf16_small25():
    return engine(25, "bfloat16", SMALL25, max_model_len=AMPLE_MAX_MODEL_LEN, async_scheduling=True)


def test_a_request_three_times_the_device_pool_is_served(bf16_ample, bf16_small25):
    """24 usable pages hold 1,536 MLA tokens; the prompt has 4,400 (2.9 times as many; the largest
    prompt this pool admits is 4,480: the indexer keeps 10 pages on the device for it next to the
    10-page lease and the 4-page window). It is admitted with an in-flight
    window, its earlier chunks are copied to the host and released as the prefill proceeds, and later
    chunks read them through the hot buffer. Its chunks are sized by what their selections fill
    (adaptive prefill sizing): some overflow the 640-row lease and are kept up to their first
    dropped selection, so the prefill takes fewer hot steps than the worst-case bound's 10 rows a
    step would, and its lease grows past the 640 rows into the pool's free pages while it runs
    alone (`prefill_buffer_max_size`: the hot state is 1,536 rows wide; it takes free pages and the
    request's own clean ones, and gives them back at the next step another request needs them);
    the tokens still equal the ample run's, and the device pages the request cannot
    give back (all it holds but its clean pages, which it keeps only while the pool has room, and its
    grown lease pages) never exceed the planner's in-flight window. The HiSparse engine schedules asynchronously
    (serving/async_scheduling.py): a chunk that may be cut is not counted at dispatch, and its
    step is read back before the next schedule (the synchronous engine's truncation is tested
    in tests/sharding/test_hisparse_parallel.py and tests/serving/test_hisparse_policy.py). Both
    runs ask for prompt logprobs: those of the rows a cut chunk computes again are replaced."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(10, 490, 4400).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outs = {}
    peak = 0
    prompt_lps = {}
    for name, e in (("ample", bf16_ample), ("hisparse", bf16_small25)):
        e.add_request("long", prompt, params)
        toks, lps = [], []
        schedule = e.scheduler.schedule
        rows = count_prompt_rows(e, len(prompt))
        try:
            while e.has_unfinished_requests():
                for o in e.step():
                    toks += o.new_token_ids
                    lps += o.new_logprobs or []
                    if o.prompt_logprobs is not None:
                        prompt_lps[name] = np.array([x.logprob for x in o.prompt_logprobs[1:]])
                assert e.audit() == []
                if e.hisparse is not None and e.kv.has_request("long"):
                    # (a grown lease's pages past prefill_buffer_size go back at the next step
                    # another request needs them: the window counts the lease it is sure of)
                    pol = e.hisparse.policy
                    grown = max(0, len(pol.lease_of("long")) - pol.max_pages)
                    peak = max(peak, device_pages(e, "long") - grown - len(pol.releasable(
                        e.scheduler.get_request("long"))))
        finally:
            e.scheduler.schedule = schedule  # the shared ample engine goes on unwrapped
        outs[name] = (toks, lps, e, rows[0])
    e = outs["hisparse"][2]
    pol = e.hisparse.policy
    assert e.async_scheduling
    # Every prompt row was computed once, and every row past a cut once more (a chunk counted
    # at dispatch and cut afterwards would skip them). (The sampled logprobs differ from the
    # ample run's by up to 3.3e-2, synchronously too: bf16 cache rows written by chunks of other
    # sizes; the tokens are held to the equality rule below.)
    assert outs["ample"][3] == len(prompt) and outs["hisparse"][3] == len(prompt) + pol.num_truncated_rows
    assert e.scheduler.num_preemptions_total == 0 and e.hisparse.device.misses > 0
    assert pol.num_truncated_chunks > 0 and e.hisparse.device.dropped > 0  # chunks really overflowed
    assert pol.num_grown_steps > 0 and pol.grow_pages == 1536 // 64  # the lease grew into free pages
    sure = 640 // 64
    assert e.runner.num_hot_steps < (len(prompt) - 1536) / sure  # fewer hot steps than the worst-case bound's
    plan = e.hisparse.plan(25, AMPLE_MAX_MODEL_LEN, 64)
    assert 0 < peak <= plan.first_pages, (peak, plan)
    lm = api.load(cache_dtype="bfloat16")
    compare_streams({"long": outs["ample"][0]}, {"long": outs["hisparse"][0]}, {"long": outs["ample"][1]},
                    {"long": prompt}, lm)
    # Prompt logprobs (serving/prompt_logprobs.py) are written by position, so the rows of a cut
    # chunk, computed from dropped selections, are replaced when computed again: they equal the
    # ample run's (observed equal; keeping the first value written instead differs by up to 2.7).
    assert np.abs(prompt_lps["hisparse"] - prompt_lps["ample"]).max() < 1e-3


def test_a_lease_is_squeezed_instead_of_preempting(bf16_ample, bf16_small25):
    """Four requests on one 384-token prefix (40 tokens of their own, 160 output tokens), one
    step apart, on the 25-page pool: as they grow, nothing is left to release (their own clean
    pages and the pages they share are released already, and each holds a 2-page decode lease),
    so the engine before squeezed leases preempted one of them here. Now the leases are squeezed
    to the fewest rows a decode step needs (index_topk: one page) instead, and read back to the
    decode size once the pressure is gone: nobody is preempted, and the streams equal the ample
    run's (docs/design.md §10), every step audited."""
    e = bf16_small25
    pol = e.hisparse.policy
    rng = np.random.default_rng(1)
    base = rng.integers(10, 490, 384).tolist()
    prompts = {f"sq{i}": base + rng.integers(10, 490, 40).tolist() for i in range(4)}
    preempted, squeezed = e.scheduler.num_preemptions_total, pol.num_squeezed_steps
    streams, lps = {}, {}
    for name, eng in (("ample", bf16_ample), ("hisparse", e)):
        toks = {rid: [] for rid in prompts}
        logprobs = {rid: [] for rid in prompts}
        waiting = list(prompts)
        while waiting or eng.has_unfinished_requests():
            if waiting:  # one new request a step
                rid = waiting.pop(0)
                eng.add_request(rid, prompts[rid], SamplingParams(temperature=0, max_tokens=160, ignore_eos=True,
                                                                  logprobs=2 if name == "ample" else None))
            for o in eng.step():
                toks[o.request_id] += o.new_token_ids
                logprobs[o.request_id] += o.new_logprobs or []
            assert eng.audit() == [], eng.audit()
        streams[name], lps[name] = toks, logprobs
    assert e.scheduler.num_preemptions_total == preempted
    assert pol.num_squeezed_steps > squeezed  # the pressure really squeezed a lease
    assert pol.least_pages == 1 < pol.dec_pages == 2
    from prometheus_client.parser import text_string_to_metric_families

    from serving.metrics import PrometheusStatLogger
    exposed = {s.name: s.value for fam in text_string_to_metric_families(
        PrometheusStatLogger("tiny", e.gauges).render().decode()) for s in fam.samples}
    assert exposed["vllm:hisparse_squeezed_lease_steps_total"] == pol.num_squeezed_steps > 0
    assert e.pool.num_free == e.pool.num_usable_blocks
    assert e.hisparse.host.blocks.num_free == e.hisparse.host.num_usable
    compare_streams(streams["ample"], streams["hisparse"], lps["ample"], prompts, api.load(cache_dtype="bfloat16"))


def count_prompt_rows(e, prompt_len: int) -> list[int]:
    """Count the prompt rows `e`'s scheduler schedules from now on → a one-element list holding
    the running count."""
    count, schedule = [0], e.scheduler.schedule

    def counting():
        out = schedule()
        count[0] += sum(max(0, min(sr.start_pos + sr.num_new_tokens, prompt_len) - sr.start_pos)
                        for sr in out.scheduled)
        return out

    e.scheduler.schedule = counting
    return count


def device_pages(e, rid: str) -> int:
    """Device pages request `rid` holds: its own (not released, not placeholder) table entries in
    every group, plus its hot lease."""
    n = 0
    for g in e.kv.groups:
        t = e.kv.table(rid, g.name)
        n += sum(1 for i in range(len(t.blocks)) if t.is_owned(i))
    return n + len(e.hisparse.policy.lease_of(rid))


def test_conversation_user_tokens_are_deterministic():
    assert user_tokens(1, 2, 5) == user_tokens(1, 2, 5) != user_tokens(2, 2, 5)


def test_without_pressure_every_step_is_the_plain_program(bf16_ample, bf16_hisparse):
    """The issue's "with no pressure the engine behaves and performs as today": on a pool that holds
    everything, no request takes a hot lease, every step runs the non-HiSparse program (no
    resolver, no host reads) and the streams equal the baseline's bit for bit; on the small pool
    the hot path runs."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(10, 490, 700).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(e, audit_each_step=False):
        for i, p in enumerate(prompts):
            e.add_request(f"p{i}", p, params)
        outs = {}
        while e.has_unfinished_requests():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if audit_each_step:
                assert e.audit() == []
        return outs

    base = run(bf16_ample)
    hs = engine(AMPLE, "bfloat16", HISPARSE, max_model_len=AMPLE_MAX_MODEL_LEN)
    assert run(hs) == base
    assert hs.runner.num_hot_steps == 0 and hs.hisparse.device.misses == 0
    small = bf16_hisparse  # the module's small-pool HiSparse engine
    before = small.runner.num_hot_steps
    sync = run(small)
    assert small.runner.num_hot_steps > before
    # Asynchronous scheduling on the hot path (leases, host reads, write-through copies completed
    # when their program is dispatched): the synchronous run's tokens, audits clean every step.
    small.set_async_scheduling(True)
    try:
        before = small.runner.num_hot_steps
        outs = run(small, audit_each_step=True)
    finally:
        small.set_async_scheduling(False)
    assert outs == sync and small.runner.num_hot_steps > before


def test_start_up_warns_when_hisparse_admits_shorter_prompts_than_max_model_len(caplog):
    """A pool too small for --max-model-len under HiSparse says so at start-up, naming the bound
    and the largest prompt admitted; a prompt one token longer is refused with the same figure."""
    import logging
    import re

    with caplog.at_level(logging.WARNING, logger="serving.engine"):
        e = engine(25, "bfloat16", {"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 640}},
                   max_model_len=9216)
    notes = [r.getMessage() for r in caplog.records if "will be refused" in r.getMessage()]
    assert len(notes) == 1 and "hisparse_config.prefill_buffer_size" in notes[0], notes
    largest = int(re.search(r"longer than (\d+) tokens", notes[0]).group(1))
    assert 0 < largest < 9216
    with pytest.raises(ValueError, match=f"largest prompt this engine admits is {largest} tokens"):
        e.add_request("long", [5] * (largest + 1), SamplingParams(max_tokens=1))
    # The same bound caps prompt + output: the scheduler would finish a request with "length" at
    # largest + 1 tokens, so that is the engine's context length, and a prompt + max_tokens beyond
    # it is refused up front (naming both lengths and the bound) instead of being cut short.
    assert f"limited to {largest + 1} tokens" in notes[0]
    assert e.effective_max_model_len == largest + 1 == e.scheduler.max_request_tokens
    assert "--max-model-len is 9216" in e.max_model_len_note() and "prefill_buffer_size" in e.max_model_len_note()
    with pytest.raises(ValueError, match=f"exceeds the {largest + 1} tokens .*prefill_buffer_size"):
        e.add_request("long output", [5] * (largest - 10), SamplingParams(max_tokens=12))
    e.add_request("fits", [5] * (largest - 10), SamplingParams(max_tokens=11))
    e.abort("fits")
    assert not e.has_unfinished_requests() and e.audit() == []
