"""Asynchronous scheduling under MTP speculation (`serving.spec_decode.feed`, docs/async_scheduling.md)
against the synchronous engine.

The trained `tiny-recall` checkpoint on copy prompts accepts 0 … k drafts from step to step (per-
position acceptance ≈ 0.98 / 0.67 / 0.41 at k = 3, docs/tiny_recall.md), so the rows the host
schedules for a request with a step in flight really are moved on the device by different
accepted counts. One engine (k = 3, compiled at start-up) runs each workload synchronously, then
asynchronously: tokens, finish reasons and logprobs must be equal — greedy and seeded temperature-1
requests, stops by `max_tokens` (1, 2, …), by the length limit in the middle of the verification
rows and by stop tokens — with audits after every step and no page left at the end. The
synchronous engine is the independent result: its inputs are all known on the host.
"""

from __future__ import annotations

import numpy as np
import pytest

from serving.types import SamplingParams
from tests.helpers.mtp_async import (
    MAX_MODEL_LEN,
    assert_same,
    copy_prompts,
    drive,
    mtp_engine,
)


@pytest.fixture(scope="module")
def prompts():
    return copy_prompts(6)


@pytest.fixture(scope="module")
def engine():
    e = mtp_engine(enable_prefix_caching=True, skip_precompile=False)
    yield e
    assert not e.has_unfinished_requests() and e.audit() == []
    assert e.pool.num_free == e.pool.num_usable_blocks, "KV pages leaked"


def spec_counters(engine) -> np.ndarray:
    """The engine's spec-decode totals: drafts, draft tokens, accepted tokens, accepted per position."""
    s = engine.spec_stats
    return np.array([s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, *s.accepted_per_pos])


def test_streams_equal_the_synchronous_engine(engine, prompts):
    """Greedy and seeded temperature-2 requests (spread enough that a draw depends on its key) with logprobs; `max_tokens` 1, 2, 5 (stops while
    the next step verifies drafts), a prompt that reaches the length limit inside its verification
    rows, prefix-cache hits (every prompt shares the chat template's head): the synchronous run's
    tokens, finish reasons and logprobs, with drafts accepted in the fed steps."""
    long_prompt = (prompts[0] * 3)[: MAX_MODEL_LEN - 19]  # 19 positions left: ends with "length"
    max_tokens = [60, 1, 2, 5, 60, 30, None]  # (None: up to the length limit)
    reqs = {}
    for i, (p, mt) in enumerate(zip([*prompts, long_prompt], max_tokens)):
        sp = {"temperature": 0} if i % 2 == 0 else {"temperature": 2.0, "seed": 100 + i}
        reqs[f"r{i}"] = (p, SamplingParams(max_tokens=mt, ignore_eos=True, logprobs=2, **sp))
    c0 = spec_counters(engine)
    sync = drive(engine, reqs, False)
    c1 = spec_counters(engine)
    asyn = drive(engine, reqs, True)
    assert_same(sync, asyn)
    # The verification statistics too: the drafts the fed steps really verified, not those scheduled.
    assert (spec_counters(engine) - c1).tolist() == (c1 - c0).tolist() and c1[2] > c0[2]
    assert sync[1]["r6"] == "length" and len(sync[0]["r6"]) == 19
    assert [len(sync[0][f"r{i}"]) for i in (1, 2, 3)] == [1, 2, 5]
    # Most steps of the asynchronous run took their rows from the step in flight, verifying drafts.
    assert len(asyn[3]) > 10 and sum(asyn[3]) > 3 * len(asyn[3])
    print(f"\nfed steps {len(asyn[3])}, drafts verified in them {sum(asyn[3])}")


def test_stop_tokens_and_aborts_while_a_step_is_in_flight(engine, prompts):
    """A request stopping on a stop token among its accepted drafts was already scheduled again:
    nothing more is streamed for it and its pages come back; aborts between steps free everything;
    the others keep the synchronous run's streams."""
    base = {f"s{i}": (p, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
            for i, p in enumerate(prompts[:4])}
    free = drive(engine, base, False)[0]
    # Stop each request on a token it emits mid-way (the 9th, 13th, …): a stop among accepted drafts.
    reqs = {rid: (p, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0,
                                    stop_token_ids=[free[rid][8 + 4 * i]]))
            for i, (rid, (p, _)) in enumerate(base.items())}
    # And one that may not stop before 14 tokens on ids it emits from its 15th on (`min_tokens` bans them in
    # the verification rows still before it: which ones depends on the step in flight's accepted
    # count, so the engine reads that step back first).
    m = drive(engine, {"m": (prompts[4], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))}, False)[0]["m"]
    reqs["m"] = (prompts[4], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0, min_tokens=14,
                                            stop_token_ids=[m[14], m[15], m[16]]))
    c0 = spec_counters(engine)
    sync = drive(engine, reqs, False)
    c1 = spec_counters(engine)
    asyn = drive(engine, reqs, True)
    assert_same(sync, asyn)
    assert all(r == "stop" for r in sync[1].values()) and len(sync[0]["m"]) == 15  # stopped on its 15th token
    # The step computed after a request stopped is dropped, its verifications too: the same counters.
    assert (spec_counters(engine) - c1).tolist() == (c1 - c0).tolist()
    aborted = drive(engine, base, True, aborts={3: ["s1"], 6: ["s2"]})
    assert aborted[1]["s1"] == aborted[1]["s2"] == "abort"
    for rid in ("s0", "s3"):
        assert aborted[0][rid] == free[rid]
    for rid in ("s1", "s2"):
        assert aborted[0][rid] == free[rid][: len(aborted[0][rid])]


def test_the_feed_moves_rows_by_the_accepted_count_and_cuts_the_drafts_at_the_limits():
    """`apply_spec_feed` on hand-built inputs, against the inputs a synchronous step would get
    (slots from `glm53.batch.page_slots`, the host's formula): request 0 (rows 0–3, step in flight
    row 1 accepted 2 of its drafts) moves by 2 and may verify only 1 draft more (limit 3 − 2);
    request 1 (rows 4–5, from row 0, nothing accepted) stays; row 6 is not fed. A position past
    the block table writes nothing."""
    import jax.numpy as jnp

    from glm53.batch import page_slots
    from serving.spec_decode.feed import apply_spec_feed
    from serving.spec_decode.inputs import SpecBatch

    tpp, k = 4, 3
    table = np.array([[7, 3, 5, 1], [2, 6, 0, 0], [0, 0, 0, 0]], np.int32)  # 3 request rows, 4 pages each
    ids = np.array([0, 0, 0, 0, 0, 0, 42], np.int32)
    pos = np.array([9, 10, 11, 12, 5, 6, 3], np.int32)  # as if nothing was accepted
    req = np.array([0, 0, 0, 0, 1, 1, 2], np.int32)
    slots = {"g": np.full(7, -9, np.int32)}
    steps = np.array([10, 4, 0], np.int32)
    feed = (np.array([1, 1, 1, 1, 0, 0, -1], np.int32), np.array([0, 1, 2, 3, 0, 1, -1], np.int32),
            np.array([1, 1, 1, -1, 0, -1, -1], np.int32), np.array([0, 1, 2, -1, 0, -1, -1], np.int32),
            np.array([1, 0, -1], np.int32), np.array([3, 5, -1], np.int32))
    toks = np.array([[50, 51, 52, 53], [60, 61, 62, 63]], np.int32)  # step in flight: rows 0 and 1
    acc = np.array([0, 2], np.int32)
    drafts = np.array([[70, 71, 72], [80, 81, 82]], np.int32)
    sp = SpecBatch(np.array([0, 4, 0], np.int32), np.zeros((3, k), np.int32), np.array([3, 1, 0], np.int32),
                   np.array([True, True, False]), np.array([0, 0, 0, 0, 0, 0, 9], np.int32), np.int32(k))
    out_ids, out_pos, out_slots, out_steps, out_sp = apply_spec_feed(
        ids, pos, req, slots, {"g": table}, steps, sp, tuple(map(jnp.asarray, feed)),
        (jnp.asarray(toks), jnp.asarray(acc), jnp.asarray(drafts)), tokens_per_page={"g": tpp}, dp=1)
    # request 0: emitted token = toks[1, acc 2] = 62, then drafts 80, 81, 82 at positions 11 … 14
    assert np.asarray(out_ids).tolist() == [62, 80, 81, 82, 50, 70, 42]
    assert np.asarray(out_pos).tolist() == [11, 12, 13, 14, 5, 6, 3]
    want = [*page_slots(table[0], [11, 12, 13, 14], tpp), *page_slots(table[1], [5, 6], tpp)]
    assert np.asarray(out_slots["g"]).tolist()[:6] == want and out_slots["g"][6] == -9
    assert np.asarray(out_sp.num_draft_B).tolist() == [1, 1, 0]  # min(3, 3 − 2), min(1, 5 − 0)
    assert np.asarray(out_sp.draft_BK).tolist() == [[80, 0, 0], [70, 0, 0], [0, 0, 0]]
    assert np.asarray(out_sp.mtp_ids_T).tolist() == [80, 81, 82, 0, 70, 0, 9]
    assert np.asarray(out_steps).tolist() == [12, 4, 0]
    # Moved past the table (4 pages of 4 tokens) or onto a null page: slot −1 (nothing written).
    far = apply_spec_feed(ids, pos + np.array([4, 4, 4, 4, 4, 4, 0], np.int32), req, slots, {"g": table}, steps, sp,
                          tuple(map(jnp.asarray, feed)), (jnp.asarray(toks), jnp.asarray(acc), jnp.asarray(drafts)),
                          tokens_per_page={"g": tpp}, dp=1)[2]["g"]
    # request 0 at 15 … 18 (15 on its last page, the rest past the table); request 1 at 9, 10 (null page)
    assert np.asarray(far).tolist()[:6] == [1 * tpp + 3, -1, -1, -1, -1, -1]


def test_background_variants_are_compiled_for_the_speculative_steps_placements(engine, prompts):
    """The masked and prompt-logprob variants a server compiles in the background
    (`serving.runner_variants`) must take their arguments as a speculative step passes them (ids,
    positions, slots, step counters and `SpecBatch` from `_spec_inputs`), else the first
    constrained or scoring request compiles on the engine thread. Checked against the arguments of
    a real step (no compile here: the jobs' abstract arguments only)."""
    from serving.runner_variants import _placed_as

    runner = engine.runner
    seen = []
    orig = runner._step

    def spy(*args):
        seen.append(args)
        return orig(*args)

    spy._cache_size = orig._cache_size
    runner._step = spy
    try:
        drive(engine, {"v": (prompts[0], SamplingParams(max_tokens=4, temperature=0))}, False)
    finally:
        runner._step = orig
    jobs = {j.key: j for j in runner.variant_jobs(bitmask_words=16, forward_only=False)}
    step_args = seen[-1]
    masked = jobs["masked", step_args[1].input_ids_T.shape[0], True].args
    scoring = jobs["prompt-logprobs", step_args[1].input_ids_T.shape[0], True].args
    assert _placed_as(masked[:len(step_args)], step_args)
    assert _placed_as(scoring[:len(step_args)], step_args)


def test_hybrid_hisparse_under_pressure_streams_equal_the_synchronous_engine():
    """Hybrid HiSparse + MTP (k = 3), the reference deployment's pairing, schedules asynchronously
    (the engine's default): four copy conversations of 300–480 tokens decoding 80 tokens each on a
    16-page pool (one request fully resident takes 12), so running requests release clean pages to
    the host pool and verify their drafts through hot leases while the next step's rows are fed
    from the step in flight. Fed rows are counted at dispatch (their selections always fit the
    lease: `HiSparsePolicy.may_truncate`), and the lease is sized by the rows, not by the positions
    the accepted drafts may move them (`allocate(lookahead=)`). Tokens, finish reasons, logprobs
    and the spec-decode counters equal the synchronous run's (greedy and a seeded temperature-2
    request); nothing is preempted, no dropped selection outside a truncation, no page or host block
    left. No prefix caching: both runs start from an empty pool."""
    from tests.helpers.mtp_async import copy_conversations, mtp_engine

    e = mtp_engine(max_model_len=640, num_gpu_blocks_override=16, enable_prefix_caching=False,
                   attention_config={"hisparse_config": {"host_pool_gib": 0.02}}, async_scheduling=None)
    assert e.async_scheduling  # (the server's default turns it on: no feature needs synchronous steps)
    prompts = copy_conversations([5, 6, 4, 6])
    assert [len(p) for p in prompts] == [413, 472, 300, 478]
    reqs = {f"h{i}": (p, SamplingParams(max_tokens=80, ignore_eos=True, logprobs=2,
                                        **({"temperature": 2.0, "seed": 7} if i == 2 else {"temperature": 0})))
            for i, p in enumerate(prompts)}
    fed_excluded = []
    orig_mark = e.scheduler.mark_in_flight

    def mark(sched, exclude=frozenset()):  # fed rows that were not counted at dispatch
        fed_excluded.extend(sr.request_id for sr in sched.scheduled if sr.spec_limit is not None and sr.request_id in exclude)
        return orig_mark(sched, exclude)

    pol, dev = e.hisparse.policy, e.hisparse.device
    c0, r0, m0 = spec_counters(e), pol.num_released, dev.misses
    sync = drive(e, reqs, False)
    c1, r1, m1 = spec_counters(e), pol.num_released, dev.misses
    hot_fed = []
    e.scheduler.mark_in_flight = mark
    try:
        asyn = drive(e, reqs, True, hot_fed=hot_fed)
    finally:
        del e.scheduler.mark_in_flight
    assert_same(sync, asyn)
    assert (spec_counters(e) - c1).tolist() == (c1 - c0).tolist() and c1[2] > c0[2]
    print(f"\nreleased {r1 - r0} / {pol.num_released - r1}, misses {m1 - m0} / {dev.misses - m1} (sync / async); "
          f"fed steps {len(asyn[3])}, on the hot program {sum(hot_fed)}")
    assert r1 - r0 > 0 and pol.num_released - r1 > 0 and dev.misses - m1 > 0  # pages left the device in both runs
    assert sum(hot_fed) > 10 and fed_excluded == []  # fed verification rows resolved through leases, counted at dispatch
    assert e.scheduler.num_preemptions_total == 0 and dev.drops_outside_truncation == 0
    assert e.pool.num_free == e.pool.num_usable_blocks
    assert e.hisparse.host.blocks.num_free == e.hisparse.host.num_usable


def test_hybrid_hisparse_squeezes_leases_and_preempts_while_steps_are_in_flight():
    """Four requests on one 384-token prefix (a copy conversation's head, 40 tokens of their own,
    160 output tokens), one arriving per step, on an 18-page pool with prefix caching: as they grow
    nothing is left to release, so leases are squeezed to the fewest rows a verification step needs
    ((k + 1) × index_topk: 4 pages instead of 5, `HiSparsePolicy._squeeze`, which allocates the
    lookahead's pages too) and requests are preempted while the step after theirs is in flight.
    The asynchronous run goes first (on an empty prefix cache, under the most pressure); its
    tokens, finish reasons and logprobs equal the synchronous run's, and nothing is left."""
    from tests.helpers.engine_drive import drive as drive_events
    from tests.helpers.mtp_async import copy_conversations, mtp_engine

    e = mtp_engine(max_model_len=640, num_gpu_blocks_override=18, enable_prefix_caching=True,
                   attention_config={"hisparse_config": {"host_pool_gib": 0.05}})
    pol = e.hisparse.policy
    assert (pol.dec_pages, pol.least_pages) == (5, 4)
    convs = copy_conversations([6, 5, 5, 6, 5])
    reqs = {f"sq{i}": (convs[0][:384] + convs[i + 1][-40:],
                       SamplingParams(temperature=0, max_tokens=160, ignore_eos=True, logprobs=2)) for i in range(4)}
    arrivals = {i: [("add", rid)] for i, rid in enumerate(reqs)}
    asyn = drive_events(e, reqs, True, arrivals)
    squeezed, preempted = pol.num_squeezed_steps, e.scheduler.num_preemptions_total
    print(f"\nasynchronous run: {squeezed} squeezed lease steps, {preempted} preemptions, "
          f"{pol.num_released} pages released")
    assert squeezed > 0 and preempted > 0 and pol.num_released > 0
    sync = drive_events(e, reqs, False, arrivals)
    assert_same(sync, asyn)
    assert e.hisparse.device.drops_outside_truncation == 0
    assert not e.has_unfinished_requests() and e.audit() == []
    assert e.pool.num_free == e.pool.num_usable_blocks
    assert e.hisparse.host.blocks.num_free == e.hisparse.host.num_usable
