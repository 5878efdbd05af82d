"""Admission against the whole prompt, and prefix caching over the shared pool, on the scheduler
with the paged fake runner of test_scheduler (it writes every token's KV through the slot
mappings of both groups and reads the whole history back through the block tables before each
sample, and refuses writes to shared pages): any wrongly shared, stale or evicted-but-still-used
page changes the tokens, which are compared with each request run alone without any cache."""

from __future__ import annotations

import random

import pytest

from serving.prefix_cache import chain_hash
from serving.request import Request
from tests.serving.test_scheduler import VOCAB, make_engine, prompt  # noqa: F401 (fixture)

# The test groups have 4 (mla) and 16 (indexer) tokens per page: hash unit 4, hits in steps of 4;
# an indexer page a hit ends inside is copied on write (or taken over when nobody holds it).


def test_long_prompts_are_admitted_whole_and_never_preempt_themselves(make_engine):
    # 19 usable pages; each request needs 11 mla + 3 indexer pages for its 44 tokens, so only one
    # fits at a time. Admitting against the first chunk alone would start both and then preempt.
    e = make_engine(num_blocks=20, max_num_batched_tokens=8, max_model_len=64)
    e.add("a", prompt(1, 40), max_tokens=4, ignore_eos=True)
    e.add("b", prompt(2, 40), max_tokens=4, ignore_eos=True)
    e.run()
    e.check_against_reference()
    assert e.sched.num_preemptions_total == 0
    first_b = next(i for i, s in enumerate(e.steps) if any(r.request_id == "b" for r in s.scheduled))
    last_a = max(i for i, s in enumerate(e.steps) if any(r.request_id == "a" for r in s.scheduled))
    assert first_b > last_a


def test_chain_hash_names_the_whole_prefix():
    a = chain_hash(b"root", [1, 2, 3, 4])
    assert chain_hash(a, [5, 6, 7, 8]) != chain_hash(chain_hash(b"root", [1, 2, 3, 5]), [5, 6, 7, 8])
    assert chain_hash(a, [5, 6, 7, 8]) == chain_hash(chain_hash(b"root", [1, 2, 3, 4]), [5, 6, 7, 8])


def _run_keeping_tables(e, rid):
    """Run until `rid` finishes; returns its last block tables."""
    tables = {}
    while rid in e.sched.requests:
        if e.kv.has_request(rid):
            tables = {g: e.kv.block_table(rid, g) for g in ("mla", "indexer")}
        e.step()
    e.run()
    return tables


def test_hit_skips_compute_shares_pages_and_matches_the_uncached_tokens(make_engine):
    e = make_engine(num_blocks=64, max_num_batched_tokens=64, max_model_len=96, prefix_caching=True)
    base = prompt(3, 40)
    e.add("a", base, max_tokens=5, ignore_eos=True)
    a_tables = _run_keeping_tables(e, "a")
    # b shares a's first 37 tokens: the hit is 36 (9 units of 4). It ends inside a's third indexer
    # page (positions 32..47), which nobody holds any more: b takes it over, no copy.
    e.add("b", base[:37] + prompt(4, 6), max_tokens=5, ignore_eos=True)
    e.add("c", prompt(5, 30), max_tokens=3, ignore_eos=True)  # nothing in common
    e.step()
    sched = {s.request_id: s for s in e.steps[-1].scheduled}
    assert (sched["b"].start_pos, sched["b"].num_new_tokens) == (36, 7)
    assert (sched["c"].start_pos, sched["c"].num_new_tokens) == (0, 30)
    assert e.added["b"].num_cached_tokens == 36 and e.added["c"].num_cached_tokens == 0
    assert e.kv.block_table("b", "mla")[:9] == a_tables["mla"][:9]
    assert e.kv.block_table("b", "indexer")[:3] == a_tables["indexer"][:3]
    assert e.steps[-1].page_copies == [] and e.prefix_cache.copies == 1
    # d (= b's prompt) arrives while b decodes: hit 40, ten shared mla pages, two shared indexer
    # pages, and b's third indexer page (b still writes to it) copied to a page of d's own.
    e.add("d", base[:37] + prompt(4, 6), max_tokens=2, ignore_eos=True)
    e.step()
    shared = e.kv.block_table("b", "mla")[:10]
    assert e.kv.block_table("d", "mla")[:10] == shared
    assert all(e.pool.refcount(b) == 2 for b in shared)
    b_idx, d_idx = e.kv.block_table("b", "indexer"), e.kv.block_table("d", "indexer")
    assert d_idx[:2] == b_idx[:2] and d_idx[2] != b_idx[2]
    assert e.steps[-1].page_copies == [(b_idx[2], d_idx[2])] and e.runner.num_copies == 1
    e.run()
    e.check_against_reference()
    assert e.prefix_cache.hits == 36 + 40 and e.prefix_cache.queries == 40 + 43 + 30 + 43
    assert [o for s in e.steps for o in s.scheduled if o.request_id == "d"][0].num_new_tokens == 3


def test_copy_happens_exactly_when_a_hit_ends_inside_a_held_page(make_engine):
    """Hits of 4, 8, 16, 20 and 36 tokens on pages a running request holds: a device copy for
    every hit that is not a multiple of the 16-token indexer page, none for the others."""
    e = make_engine(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
                    prefix_caching=True)
    stem = prompt(13, 40)
    e.add("owner", stem, max_tokens=40, ignore_eos=True)  # keeps every page held
    e.step()
    for n in (4, 8, 16, 20, 36):
        copies = e.runner.num_copies
        e.add(f"h{n}", stem[:n] + [n % VOCAB] * 3, max_tokens=3, ignore_eos=True)
        e.step()
        sr = next(s for s in e.steps[-1].scheduled if s.request_id == f"h{n}")
        assert sr.start_pos == e.added[f"h{n}"].num_cached_tokens == n
        assert e.runner.num_copies - copies == (1 if n % 16 else 0), n
        if n % 16:
            owner = e.kv.block_table("owner", "indexer")[n // 16]
            assert e.steps[-1].page_copies == [(owner, e.kv.block_table(f"h{n}", "indexer")[n // 16])]
    e.run()
    e.check_against_reference()


def test_whole_prompt_hit_recomputes_the_last_token(make_engine):
    e = make_engine(num_blocks=64, max_num_batched_tokens=64, max_model_len=96, prefix_caching=True)
    p = prompt(6, 48)
    e.add("a", p, max_tokens=2, ignore_eos=True)
    e.run()
    e.add("b", p, max_tokens=2, ignore_eos=True)
    e.step()
    sr = e.steps[-1].scheduled[0]
    assert (sr.start_pos, sr.num_new_tokens) == (44, 4)  # 47 usable tokens -> 44 (units of 4)
    e.run()
    e.check_against_reference()


def test_unreferenced_cached_pages_are_evicted_lru_under_pressure(make_engine):
    e = make_engine(num_blocks=24, max_num_batched_tokens=64, max_model_len=64, prefix_caching=True)
    first = prompt(7, 33)
    e.add("a", first, max_tokens=1, ignore_eos=True)
    e.run()
    assert e.prefix_cache.num_entries == 8 + 2  # 32 tokens: 8 mla pages, 2 indexer pages
    for i in range(3):  # fill the pool with other prompts: a's pages must be reused
        e.add(f"x{i}", prompt(100 + i, 60), max_tokens=2, ignore_eos=True)
        e.run()
    assert e.evicted and e.prefix_cache.num_entries <= e.pool.num_usable_blocks
    e.add("again", first, max_tokens=1, ignore_eos=True)
    e.step()
    assert e.added["again"].num_cached_tokens == 0  # evicted: recomputed, not read stale
    e.run()
    e.check_against_reference()
    n = e.prefix_cache.num_entries
    assert n and e.prefix_cache.reset() == n and e.prefix_cache.num_entries == 0
    assert e.sched.audit() == []


def test_random_shared_prefix_workload_with_preemption_and_eviction(make_engine):
    rng = random.Random(11)
    e = make_engine(num_blocks=26, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=80,
                    prefix_caching=True)
    stems = [prompt(200 + i, 40) for i in range(3)]
    arrivals = [(rng.randrange(60), f"r{i}") for i in range(30)]

    def add(rid):
        stem = rng.choice(stems)
        p = stem[: rng.randint(10, 40)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        e.add(rid, p, max_tokens=rng.randint(1, 20), ignore_eos=True)

    aborted = e.drive(rng, arrivals, add, 0.01, 6000)
    e.check_against_reference(skip=aborted)
    assert e.prefix_cache.hits > 0 and e.evicted and e.sched.num_preemptions_total > 0
    # Both copy-on-write paths ran: device copies (held pages) and pages taken over (free ones).
    assert 0 < e.runner.num_copies < e.prefix_cache.copies


def test_lookup_needs_every_group(make_engine):
    """A hit in the mla group alone (its 4-token pages) is cut where the indexer pages covering
    it are no longer cached."""
    e = make_engine(num_blocks=64, max_num_batched_tokens=64, max_model_len=96, prefix_caching=True)
    e.add("a", prompt(9, 40), max_tokens=1, ignore_eos=True)
    e.run()
    hit = e.prefix_cache.lookup(Request("probe", prompt(9, 40)))
    # 39 usable tokens -> 36: indexer pages 0 and 1 whole, page 2 up to position 35 (copy-on-write).
    assert hit.num_tokens == 36 and len(hit.blocks["mla"]) == 9 and len(hit.blocks["indexer"]) == 2
    assert set(hit.copy_from) == {"indexer"}
    for page, expect in ((1, 16), (0, 0)):
        block = hit.blocks["indexer"][page]
        assert e.prefix_cache.on_block_reuse(block, e.pool.clear_tag(block))  # as the pool would
        assert e.prefix_cache.audit() == []
        again = e.prefix_cache.lookup(Request("probe", prompt(9, 40)))
        assert again.num_tokens == expect and again.copy_from == {}
        assert len(again.blocks["mla"]) == expect // 4 and len(again.blocks["indexer"]) == expect // 16


def test_preempting_a_request_that_shares_pages_keeps_them_for_the_other(make_engine):
    # 18 usable pages. a and b share a 32-token prefix (8 mla + 2 indexer pages); each grows to
    # 53 tokens (14 + 4 pages), so both together (10 shared + 8 + 8) need 26: b must be preempted.
    e = make_engine(num_blocks=19, max_num_batched_tokens=64, max_model_len=96, prefix_caching=True)
    stem = prompt(12, 32)
    e.add("a", stem + [1], max_tokens=20, ignore_eos=True)
    e.step()
    e.add("b", stem + [2], max_tokens=20, ignore_eos=True)
    e.step()
    assert e.added["b"].num_cached_tokens == 32
    shared = e.kv.block_table("b", "mla")[:8] + e.kv.block_table("b", "indexer")[:2]
    assert all(e.pool.refcount(blk) == 2 for blk in shared)
    while e.added["b"].num_preemptions == 0:
        e.step()
    assert e.kv.block_table("a", "mla")[:8] + e.kv.block_table("a", "indexer")[:2] == shared
    assert all(e.pool.refcount(blk) == 1 for blk in shared)  # b's references are gone, a's remain
    e.run()
    e.check_against_reference()
    assert e.sched.num_preemptions_total >= 1


def test_offload_tier_brings_an_evicted_prefix_back_without_recompute(make_engine):
    """The connector's tier on the paged fake runner: a's pages are stored as they fill; others
    then take every device page; b (a's prompt plus a tail) gets a's prefix back from the host:
    the hit's pages are loaded (fake runner: host → arena before the step), nothing below the hit
    is recomputed, and the KV read back and the tokens equal the uncached run's."""
    e = make_engine(num_blocks=24, max_num_batched_tokens=64, max_model_len=96, prefix_caching=True,
                    offload_blocks=80)
    base = prompt(41, 40)
    e.add("a", base, max_tokens=3, ignore_eos=True)
    e.run()
    for i in range(3):
        e.add(f"x{i}", prompt(50 + i, 40), max_tokens=3, ignore_eos=True)
        e.run()
    e.add("b", base + prompt(60, 9), max_tokens=4, ignore_eos=True)
    e.step()
    first = {s.request_id: s for s in e.steps[-1].scheduled}["b"]
    # 40 + 9 tokens: the indexer group's full pages end at 32, so the hit is 32 (mla pages 0-7
    # and indexer pages 0-1 from the host).
    assert first.start_pos == 32 and e.prefix_cache.external_hits == 32
    assert len(e.steps[-1].page_loads) == 8 + 2
    e.run()
    e.check_against_reference()


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_with_the_offload_tier(make_engine, seed):
    _random_offload_workload(make_engine, seed)


def test_the_random_offload_workloads_hit_the_host_tier(make_engine):
    hits = [_random_offload_workload(make_engine, seed) for seed in range(8)]
    assert sum(h > 0 for h in hits) >= 4, hits


def _random_offload_workload(make_engine, seed) -> int:
    """Shared prefixes, a device pool too small to keep them, a host store small enough to evict
    too, aborts: every stream equals its uncached reference, the fake runner's KV checks pass
    (stores before loads, loads before the step, no write to a shared page), audits stay clean
    (the host store's included). Returns the external (host-tier) hit tokens."""
    rng = random.Random(seed)
    e = make_engine(num_blocks=rng.choice([32, 40, 56]), max_num_seqs=rng.choice([2, 3, 4]),
                    max_num_batched_tokens=rng.choice([8, 16, 64]), max_model_len=96, prefix_caching=True,
                    offload_blocks=rng.choice([8, 24, 80]))
    heads = [prompt(7000 + 10 * seed + h, rng.choice([32, 40, 49])) for h in range(3)]
    arrivals = [(rng.randrange(60), f"r{i}") for i in range(16)]

    def add(rid):
        head = rng.choice(heads)
        e.add(rid, head[: rng.randint(len(head) // 2, len(head))] + prompt(rng.randrange(10**6), rng.randint(0, 12)),
              max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)

    aborted = e.drive(rng, arrivals, add, 0.02, 5000)
    e.check_against_reference(skip=aborted)
    assert e.offload.audit() == [] and not e.offload.pinned
    return e.prefix_cache.external_hits
