"""The HiSparse residency policy over the scheduler, on a simulated arena and host pool
(tests/serving/hisparse_harness.py): page states dirty → clean → released → lost, write-through
copies, hot leases, admission, the prefill chunk bound and the host tier of the prefix cache.
Every test compares token streams with each request run alone and audits after every step
(no leaked or double-owned device page or host block, no off-device page without a complete
host copy, a lease wherever a page is off the device)."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.block_pool import NULL_BLOCK
from serving.hisparse.residency import HiSparsePolicy
from tests.serving.hisparse_harness import MLA_TPP, HiSparseEngine
from tests.serving.test_scheduler import prompt


def test_pressure_releases_pages_instead_of_preempting():
    # Each request needs 23 MLA + 6 indexer pages fully resident; 79 usable pages hold two, and
    # HiSparse runs all four at once at their steady footprint (indexer + lease + tail).
    e = HiSparseEngine(num_blocks=80, max_num_seqs=4)
    for i in range(4):
        e.add(f"r{i}", prompt(i, 90), max_tokens=30, ignore_eos=True)
    e.run()
    e.check_against_reference()
    assert e.sched.num_preemptions_total == 0
    assert e.max_running == 4
    assert e.runner.host_reads > 0 and e.policy.num_released > 0
    assert {"full", "mixed"} <= e.states_seen


def test_the_two_newest_pages_and_dirty_pages_are_never_released():
    e = HiSparseEngine(num_blocks=60, max_num_seqs=3)
    for i in range(3):
        e.add(f"r{i}", prompt(10 + i, 70), max_tokens=40, ignore_eos=True)
    while e.sched.has_unfinished_requests():
        e.step()
        for req in e.sched.running:
            t = e.kv.table(req.request_id, "mla")
            rec = e.policy.records[req.request_id]
            newest = (req.num_computed_tokens - 1) // MLA_TPP
            for i in set(t.released) | t.placeholders:
                assert i < newest - 1, "one of the two newest pages left the device"
                assert i in rec.host_blocks and i not in rec.pending, "a dirty page left the device"
    e.flush()
    e.check_against_reference()


def test_released_pages_are_reused_tail_first():
    e = HiSparseEngine(num_blocks=200, max_num_seqs=2)
    e.add("a", prompt(1, 60), max_tokens=4, ignore_eos=True)
    for _ in range(6):  # prefill and copy every sealed page
        e.step()
    req = e.sched.running[0]
    rel = e.policy.releasable(req)
    assert len(rel) >= 5
    e.policy._release_all(req, rel)
    t = e.kv.table("a", "mla")
    queue = e.pool.free_queue()
    order = [queue.index(t.blocks[i]) for i in sorted(rel, reverse=True)]
    assert order == sorted(order)  # the tail page is handed out first, the head last
    # ... and after every untagged page: a fresh page is used before a released one.
    untagged = [b for b in queue if e.pool.get_tag(b) is None]
    assert max(queue.index(b) for b in untagged) < min(order)
    e.run()
    e.check_against_reference()


def test_a_lookahead_takes_token_pages_and_the_lease_counts_query_rows():
    """Asynchronous MTP allocates pages for the positions the step in flight's accepted drafts may
    move a request's rows by (`allocate(lookahead=)`): token pages only — the hot lease is sized
    by the query rows (a decode row here), not by rows + lookahead. And a chunk may come back
    shorter (`may_truncate`) only when its rows' selections can overflow the lease: rows × K
    above the lease's rows (verification rows never are)."""
    e = HiSparseEngine(num_blocks=80, max_num_seqs=4)  # K = 4, decode lease 8 rows (2 pages)
    for i in range(4):
        e.add(f"r{i}", prompt(i, 90), max_tokens=30, ignore_eos=True)
    pol, req = e.policy, None
    while req is None and e.sched.has_unfinished_requests():
        e.step()
        req = next((r for r in e.sched.running if r.num_output_tokens and pol.off_pages(r.request_id) >= 4), None)
    assert req is not None, "no decoding request with pages off the device"
    rid, n0 = req.request_id, req.num_computed_tokens
    assert pol.allocate(req, 1, [], lookahead=MLA_TPP) == 1  # (a page further than the row alone)
    assert len(e.kv.table(rid, "mla").blocks) == -(-(n0 + 1 + MLA_TPP) // MLA_TPP)  # pages up to the moved row
    assert len(pol.records[rid].lease) == pol.dec_pages == 2 < pol._lease_pages(rid, 1 + MLA_TPP)
    lease_rows = len(pol.records[rid].lease) * MLA_TPP
    assert not pol.may_truncate(rid, lease_rows // pol.K) and pol.may_truncate(rid, lease_rows // pol.K + 1)
    e.run()
    e.check_against_reference()


@pytest.mark.parametrize("prefill_sizing", ["adaptive", "worst_case"])
def test_a_context_longer_than_the_device_pool_prefills_through_the_hot_buffer(prefill_sizing):
    # 47 usable pages hold 188 MLA tokens; the prompt has 400. Admitted with an in-flight window,
    # its earlier chunks are released as it proceeds; later chunks read them from the host pool.
    # Adaptive sizing gives its chunks more rows than the 16-row lease's worst case (4 rows), and
    # the fake runner truncates some of them (wrong KV past the cut, which must never be read).
    e = HiSparseEngine(num_blocks=48, host_blocks=200, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=480,
                       prefill_buffer=16, prefill_sizing=prefill_sizing)
    e.add("long", prompt(5, 400), max_tokens=20, ignore_eos=True)
    e.add("short", prompt(6, 30), max_tokens=20, ignore_eos=True)
    e.run()
    e.check_against_reference()
    assert e.sched.num_preemptions_total == 0 and e.runner.host_reads > 0
    if prefill_sizing == "adaptive":
        assert e.runner.num_truncated > 0 and e.policy.num_truncated_chunks == e.runner.num_truncated
    else:
        assert e.runner.num_truncated == 0


def test_host_tier_prefix_hit_starts_with_placeholders_and_counts_cached_tokens():
    e = HiSparseEngine(num_blocks=60, max_num_seqs=3, prefix_caching=True)
    base = prompt(20, 80)
    e.add("a", base, max_tokens=3, ignore_eos=True)
    e.run()
    # Evict a's device pages (MLA and indexer alike) by filling the pool with another request.
    e.add("filler", prompt(21, 150), max_tokens=2, ignore_eos=True)
    e.run()
    assert e.prefix_cache.num_host_entries >= 20
    b = e.add("b", base + prompt(22, 10), max_tokens=5, ignore_eos=True)
    e.step()
    hit = b.num_cached_tokens
    assert hit > 0 and e.prefix_cache.host_hits > 0
    t = e.kv.table("b", "mla")
    assert any(blk == NULL_BLOCK for blk in t.blocks[: hit // MLA_TPP])  # pages only in the host pool
    assert e.policy.records["b"].lease  # it reads them through the hot buffer
    e.run()
    e.check_against_reference()


def test_a_full_host_pool_falls_back_to_preemption():
    # 12 host blocks cannot hold the pages of the running requests: nothing becomes clean enough
    # to release, so the baseline's preemption takes over and the streams stay correct.
    e = HiSparseEngine(num_blocks=30, host_blocks=13, max_num_seqs=3)
    for i in range(3):
        e.add(f"r{i}", prompt(30 + i, 40), max_tokens=30, ignore_eos=True)
    e.run()
    e.check_against_reference()
    assert e.sched.num_preemptions_total > 0


def test_aborts_free_pages_and_host_blocks_in_every_state():
    rng = random.Random(3)
    e = HiSparseEngine(num_blocks=50, max_num_seqs=4, prefix_caching=True)
    for i in range(8):
        e.add(f"r{i}", prompt(40 + i, rng.randint(20, 90)), max_tokens=rng.randint(5, 30), ignore_eos=True)
    aborted = set()
    step = 0
    while e.sched.has_unfinished_requests():
        e.step()
        step += 1
        if step % 7 == 0:
            live = list(e.sched.running) + list(e.sched.waiting)
            victim = rng.choice(live).request_id
            e.sched.abort(victim)
            aborted.add(victim)
            assert e.sched.audit() == []
    e.flush()
    e.check_against_reference(skip=aborted)
    assert e.pool.num_free == e.pool.num_usable_blocks
    assert e.host_pool.blocks.num_free == e.host_pool.blocks.num_usable_blocks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.sampled_from([30, 40, 60, 90]),
    host_blocks=st.sampled_from([40, 120, 400]),
    max_num_seqs=st.sampled_from([2, 4, 6]),
    budget=st.sampled_from([8, 16, 32]),
    prefill_buffer=st.sampled_from([8, 16, 32]),
    prefix_caching=st.booleans(),
    long_shared_prefixes=st.booleans(),
    shared_release_admits=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_random_workloads_keep_every_invariant(num_blocks, host_blocks, max_num_seqs, budget, prefill_buffer,
                                               prefix_caching, long_shared_prefixes, shared_release_admits, seed):
    """Random arrivals, shared prefixes, aborts and pool sizes: the harness audits the pool, the
    host pool, the tables, the leases and the page states after every step, and every request's
    tokens equal its solo run. With `long_shared_prefixes` most requests start with most of a
    common prefix, so pages shared by several running requests fill the pool (released by all
    their sharers together; with `shared_release_admits`, also to admit requests)."""
    rng = random.Random(seed)
    e = HiSparseEngine(num_blocks=num_blocks, host_blocks=host_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_model_len=160, prefix_caching=prefix_caching,
                       prefill_buffer=prefill_buffer)
    e.policy.shared_release_admits = shared_release_admits
    bases = [prompt(1000 + k, 60) for k in range(3)]
    arrivals = []
    for i in range(rng.randint(3, 9)):
        if long_shared_prefixes and rng.random() < 0.9:
            p = bases[rng.randrange(2)][: rng.randint(40, 60)] + prompt(seed * 100 + i, rng.randint(1, 20))
        elif rng.random() < 0.5:
            p = bases[rng.randrange(3)][: rng.randint(5, 60)] + prompt(seed * 100 + i, rng.randint(1, 40))
        else:
            p = prompt(seed * 100 + i, rng.randint(1, 100))
        arrivals.append((rng.randint(0, 30), f"r{i}", p, rng.randint(1, 30)))
    arrivals.sort()
    aborted, step = set(), 0
    while arrivals or e.sched.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, rid, p, n = arrivals.pop(0)
            try:
                e.add(rid, p, max_tokens=n, ignore_eos=True)
            except ValueError:  # longer than anything this pool can hold
                pass
        if e.sched.has_unfinished_requests():
            e.step()
            if rng.random() < 0.03 and e.sched.running:
                victim = rng.choice(e.sched.running).request_id
                e.sched.abort(victim)
                aborted.add(victim)
        step += 1
        assert step < 20_000
    e.flush()
    e.check_against_reference(skip=aborted)
    assert e.pool.num_free == e.pool.num_usable_blocks and e.kv.request_ids() == []
    assert e.host_pool.blocks.num_free == e.host_pool.blocks.num_usable_blocks


def test_a_preempted_prefill_resumes_from_the_host_tier():
    """Preemption (the last resort) frees the request's pages, but the host copies of its sealed
    pages are published (the last ones by a copy that still runs) and its indexer pages stay cached:
    re-admitted, it starts from there instead of recomputing its prefix."""
    e = HiSparseEngine(num_blocks=120, max_num_seqs=2, prefix_caching=True, max_num_batched_tokens=16)
    req = e.add("long", prompt(50, 120), max_tokens=10, ignore_eos=True)
    for _ in range(5):  # 80 of 120 prompt tokens computed
        e.step()
    done = req.num_computed_tokens
    assert 0 < done < 120
    e.sched.running.remove(req)
    e.sched._preempt(req)  # what the scheduler does when nothing else makes room
    e.flush()  # the copies the preemption left (an idle engine runs them at once)
    # Someone else takes every free page but the cached (indexer) ones: its MLA pages, which sit in
    # the pool's front tier, are reused; only their host copies remain.
    taken = e.pool.allocate(len(e.pool.free_queue()) - len(e.pool._tagged))
    e.pool.free(taken)
    assert e.sched.audit() == []
    out = e.step()
    resumed = next(s for s in out.scheduled if s.request_id == "long")
    assert resumed.first_chunk and resumed.start_pos == done // 4 * 4 > 0
    assert e.prefix_cache.host_hits == resumed.start_pos  # every MLA page of the hit from the host
    e.run()
    e.check_against_reference()
    assert req.num_preemptions == 1


def _shared_prefix_run(share_release: bool, monkeypatch, num_blocks: int = 50, squeeze: bool = True,
                       on_step=None) -> HiSparseEngine:
    """Four requests on one 100-token prefix (25 shared MLA pages), admitted three steps apart,
    on a `num_blocks`-page pool (50: the shared pages alone are half of it); `on_step(e)` after
    every step."""
    with monkeypatch.context() as m:
        if not share_release:
            m.setattr(HiSparsePolicy, "_shared_candidates", lambda self, protect, leased, cost=None: [])
        if not squeeze:
            m.setattr(HiSparsePolicy, "_squeeze", lambda self, req, num_new, scheduled, lookahead=0: 0)
        e = HiSparseEngine(num_blocks=num_blocks, max_num_seqs=4, prefix_caching=True, max_model_len=200)
        base = prompt(7, 100)
        arrivals = [(3 * i, f"r{i}", base + prompt(100 + i, 4)) for i in range(4)]
        step = 0
        while arrivals or e.sched.has_unfinished_requests():
            while arrivals and arrivals[0][0] <= step:
                _, rid, p = arrivals.pop(0)
                e.add(rid, p, max_tokens=50, ignore_eos=True)
            if e.sched.has_unfinished_requests():
                e.step()
                if on_step is not None:
                    on_step(e)
            step += 1
        e.flush()
        e.check_against_reference()
    return e


def test_pages_shared_by_running_requests_are_released_by_all_of_them_together(monkeypatch):
    """A page several running requests share (a prefix-cache hit) is released by none of them
    alone; when the pool is full of such pages the policy releases them from every sharer together
    (each sharer taking a decode lease) instead of preempting. Without it the same run preempts:
    the streams equal each request run alone either way, every step audited."""
    alone = _shared_prefix_run(False, monkeypatch)
    assert alone.sched.num_preemptions_total >= 2 and alone.policy.num_released_shared == 0
    e = _shared_prefix_run(True, monkeypatch)
    assert e.sched.num_preemptions_total == 0
    assert e.policy.num_released_shared >= 20 and e.max_running == 4
    assert e.pool.num_free == e.pool.num_usable_blocks and e.kv.request_ids() == []


def test_leases_are_squeezed_to_what_a_decode_step_needs_instead_of_preempting(monkeypatch):
    """Four requests on one 100-token prefix on a 40-page pool: once their own and their shared
    clean pages are released, each holds a 2-page decode lease (device_buffer_size 8 rows, K = 4)
    and nothing is left to release, so without squeezed leases a request is preempted. With them
    the leases are cut to one page (K rows, all a one-row step can miss) instead, and grow back to
    the decode size when pages free up; nobody is preempted, and every stream equals its solo run
    (the fake runner checks each step's rows against its lease)."""
    def run(squeeze: bool):
        leases = {}  # request → the lease sizes it held, in order

        def record(e):
            for rid, rec in e.policy.records.items():
                if rec.lease and leases.setdefault(rid, [0])[-1] != len(rec.lease):
                    leases[rid].append(len(rec.lease))

        return _shared_prefix_run(True, monkeypatch, num_blocks=40, squeeze=squeeze, on_step=record), leases

    plain, _ = run(False)
    assert plain.sched.num_preemptions_total >= 1 and plain.policy.num_squeezed_steps == 0
    e, leases = run(True)
    assert e.sched.num_preemptions_total == 0 and e.policy.num_squeezed_steps > 0
    assert e.policy.least_pages == 1 < e.policy.dec_pages == 2
    # a squeezed lease went back to the decode size while its request ran on
    assert any(1 in sizes and 2 in sizes[sizes.index(1):] for sizes in leases.values()), leases
    assert e.pool.num_free == e.pool.num_usable_blocks and e.kv.request_ids() == []
    assert e.host_pool.blocks.num_free == e.host_pool.blocks.num_usable_blocks


def test_a_sharer_aborted_while_its_shared_pages_are_released_leaves_them_to_the_others():
    """Abort one sharer right after a shared release: the page stays released for the others
    (its tag now names them only), who still read it in place or, once the pool reuses it,
    from their host copies; every step audited, the others' streams equal their solo runs, no
    page or host block left."""
    e = HiSparseEngine(num_blocks=50, max_num_seqs=4, prefix_caching=True, max_model_len=200)
    base = prompt(7, 100)
    arrivals = [(3 * i, f"r{i}", base + prompt(100 + i, 4)) for i in range(4)]
    step, aborted = 0, None
    while arrivals or e.sched.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, rid, p = arrivals.pop(0)
            e.add(rid, p, max_tokens=50, ignore_eos=True)
        if e.sched.has_unfinished_requests():
            before = e.policy.num_released_shared
            e.step()
            if aborted is None and e.policy.num_released_shared > before:
                tags = {id(t): t for r in e.sched.running for t in e.kv.table(r.request_id, "mla").released.values()
                        if hasattr(t, "sharers")}
                assert tags, "the shared release left no shared tag"
                aborted = next(iter(next(iter(tags.values())).sharers))
                e.sched.abort(aborted)
                assert all(aborted not in t.sharers and t.sharers for t in tags.values())
                assert e.sched.audit() == []
        step += 1
    e.flush()
    assert aborted is not None
    e.check_against_reference(skip={aborted})
    assert e.pool.num_free == e.pool.num_usable_blocks and e.kv.request_ids() == []
    assert e.host_pool.blocks.num_free == e.host_pool.blocks.num_usable_blocks


def test_a_continuation_is_admitted_before_a_first_turn_that_does_not_fit():
    """The next turn of a conversation (a prefix-cache hit of most of its prompt) waiting behind a
    large request that does not fit is admitted first (`admission_lookahead`); without that it
    would wait, and its indexer pages would be evicted before its turn came."""
    e = HiSparseEngine(num_blocks=64, max_num_seqs=4, prefix_caching=True, max_num_batched_tokens=64)
    base = prompt(60, 60)
    e.add("t0", base, max_tokens=4, ignore_eos=True)
    e.run()
    e.add("hog", prompt(61, 100), max_tokens=30, ignore_eos=True)  # 33 + 9 pages at the end
    e.step()
    e.add("big", prompt(62, 120), max_tokens=2, ignore_eos=True)  # 38 pages: cannot fit while hog runs
    e.add("t1", base + e.streams["t0"] + prompt(63, 5), max_tokens=3, ignore_eos=True)
    out = e.step()
    ids = [s.request_id for s in out.scheduled]
    assert "t1" in ids and "big" not in ids
    assert e.added["t1"].num_cached_tokens >= 60
    e.run()
    e.check_against_reference()


@pytest.mark.parametrize("num_blocks, host_blocks, bound", [
    (12, 200, "prefill_buffer_size"),  # the device pages of the indexer keys + lease + window bind
    (24, 40, "host_pool_gib"),  # the host pool binds
])
def test_a_prompt_too_long_for_hisparse_is_refused_naming_the_bound(num_blocks, host_blocks, bound):
    """The refusal names what bounds one request under HiSparse and the largest prompt admitted;
    that prompt is admitted and one token more is refused."""
    e = HiSparseEngine(num_blocks=num_blocks, host_blocks=host_blocks, max_model_len=4000, prefill_buffer=16)
    with pytest.raises(ValueError, match=bound) as err:
        e.add("long", prompt(5, 3000), max_tokens=1)
    largest = int(re.search(r"largest prompt this engine admits is (\d+) tokens", str(err.value)).group(1))
    e.add("fits", prompt(6, largest), max_tokens=1)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        e.add("one more", prompt(7, largest + 1), max_tokens=1)
    # The start-up warning says the same: the bound and the largest prompt (none when it is enough).
    note = e.policy.admission_note(4000)
    assert note is not None and f"longer than {largest} tokens" in note and bound in note
    assert e.policy.admission_note(largest) is None


@pytest.mark.parametrize("prefill_sizing", ["adaptive", "worst_case"])
def test_a_lone_long_prefill_grows_its_lease_into_free_pages_and_gives_them_back(prefill_sizing):
    """`prefill_buffer_max_size`: the 400-token prompt alone on a 47-page pool leases up to 64 hot
    rows (16 pages, in free pages and its own clean ones) instead of 16 while nothing else runs or
    waits, so its prefill takes fewer
    steps than the same engine without growth; a second request arriving mid-prefill gets the
    pages back from the next step (the lease is at most `prefill_buffer_size` while the other
    waits or runs), the watermark stays free after every allocation of a grown lease, and every
    stream equals its request run alone."""
    steps = {}
    for grow in (None, 64):
        e = HiSparseEngine(num_blocks=48, host_blocks=200, max_num_seqs=2, max_num_batched_tokens=16,
                           max_model_len=480, prefill_buffer=16, prefill_sizing=prefill_sizing, prefill_buffer_max=grow)
        pol = e.policy
        e.add("long", prompt(5, 400), max_tokens=4, ignore_eos=True)
        n, arrived, leases_with_other = 0, False, []
        while e.sched.has_unfinished_requests():
            e.step()
            n += 1
            rec = pol.records.get("long")
            lease = len(rec.lease) if rec else 0
            if lease > pol.max_pages:
                assert len(e.sched.running) == 1 and not e.sched.waiting
                assert e.pool.num_free >= pol.watermark, (e.pool.num_free, pol.watermark)
            others = len(e.sched.running) > 1 or e.sched.waiting
            if others and "long" in {r.request_id for r in e.sched.running}:
                leases_with_other.append(lease)
            if grow and not arrived and pol.num_grown_steps >= 5:
                e.add("short", prompt(6, 30), max_tokens=20, ignore_eos=True)
                arrived = True
        e.flush()
        e.check_against_reference()
        assert e.sched.num_preemptions_total == 0 and e.runner.host_reads > 0
        assert e.pool.num_free == e.pool.num_usable_blocks
        if grow:
            assert arrived and pol.num_grown_steps >= 5
            assert leases_with_other and max(leases_with_other) <= pol.max_pages, leases_with_other
        else:
            assert pol.num_grown_steps == 0
        steps[grow] = n
    assert steps[64] < steps[None], steps
