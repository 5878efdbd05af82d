"""KVCacheManager: groups sharing one pool, block tables, slot mappings, residency hooks, audit."""

from __future__ import annotations

import random

import numpy as np
import pytest

from serving.block_pool import NULL_BLOCK, BlockPool
from serving.kv_cache import KVCacheGroupSpec, KVCacheManager, ReleasedPageTag


def make(num_blocks=17, caps=None, on_reuse=False, mtp=True):
    pool = BlockPool(num_blocks)
    groups = [KVCacheGroupSpec("mla", 4), KVCacheGroupSpec("indexer", 16)]
    if mtp:
        groups.append(KVCacheGroupSpec("mtp", 4))
    kv = KVCacheManager(pool, groups, caps)
    if on_reuse:
        pool.on_reuse = kv.on_block_reuse
    return pool, kv


def test_blocks_needed_per_group():
    _, kv = make()
    assert kv.blocks_needed("r", 0) == {"mla": 0, "indexer": 0, "mtp": 0}
    assert kv.blocks_needed("r", 17) == {"mla": 5, "indexer": 2, "mtp": 5}
    assert kv.blocks_needed(8, 17) == {"mla": 3, "indexer": 1, "mtp": 3}
    assert kv.allocate_slots("r", 5)
    assert {g: len(kv.block_table("r", g)) for g in ("mla", "indexer", "mtp")} == {
        "mla": 2, "indexer": 1, "mtp": 2}
    assert kv.blocks_needed("r", 16) == {"mla": 2, "indexer": 0, "mtp": 2}
    assert kv.blocks_needed("r", 3) == {"mla": 0, "indexer": 0, "mtp": 0}  # never shrinks
    assert kv.num_slots("r") == 8
    assert kv.audit() == []


def test_allocate_is_all_or_nothing_and_groups_compete_for_one_pool():
    pool, kv = make(num_blocks=11)  # 10 usable pages
    assert kv.can_allocate("a", 16)  # 4 + 1 + 4 = 9 pages
    assert kv.allocate_slots("a", 16)
    assert pool.num_free == 1
    assert not kv.can_allocate("b", 1)  # needs 3 pages (one per group)
    before = pool.free_queue()
    assert not kv.allocate_slots("b", 1)
    assert pool.free_queue() == before and not kv.has_request("b")
    assert kv.audit() == []


def test_freeing_one_group_lets_another_allocate():
    pool = BlockPool(9)  # 8 usable pages
    mla_only = KVCacheManager(pool, [KVCacheGroupSpec("mla", 2)])
    idx_only = KVCacheManager(pool, [KVCacheGroupSpec("indexer", 8)])
    assert mla_only.allocate_slots("a", 16)  # all 8 pages as MLA pages
    assert pool.num_free == 0
    assert not idx_only.allocate_slots("b", 64)
    mla_only.free("a")
    assert idx_only.allocate_slots("b", 64)  # the same 8 pages now hold indexer keys
    assert sorted(idx_only.block_table("b", "indexer")) == list(range(1, 9))
    assert mla_only.audit(external_refs={b: 1 for b in range(1, 9)}) == []
    assert idx_only.audit() == []


def test_capacity_moves_between_groups_of_one_manager():
    pool = BlockPool(11)  # 10 usable pages
    kv = KVCacheManager(pool, [KVCacheGroupSpec("mla", 2), KVCacheGroupSpec("indexer", 8)])
    assert kv.allocate_slots("a", 8)  # 4 mla + 1 indexer
    assert kv.allocate_slots("b", 8)  # 4 mla + 1 indexer
    assert pool.num_free == 0
    # A HiSparse-style release of a's oldest MLA pages (tail-first) makes room for b's growth.
    for i in (1, 0):
        kv.release_page("a", "mla", i)
    assert pool.num_free == 2
    assert kv.allocate_slots("b", 10)  # one more mla page and one more indexer page
    assert len(kv.block_table("b", "mla")) == 5 and len(kv.block_table("b", "indexer")) == 2
    # Both released pages were reused (tail page first), so a's entries are stale: audit says so
    # until they are marked lost (the on_reuse callback does this when wired).
    assert any("not marked lost" in e for e in kv.audit())
    kv.mark_lost("a", "mla", 0)
    kv.mark_lost("a", "mla", 1)
    assert kv.block_table("a", "mla")[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert kv.audit() == []


def test_slot_mapping_matches_per_position_formula():
    rng = random.Random(1)
    pool, kv = make(num_blocks=128)
    for rid, n in (("x", 3), ("y", 37), ("z", 50)):
        assert kv.allocate_slots(rid, n)
    kv.free("x")  # shuffle the free queue so tables are not contiguous
    assert kv.allocate_slots("w", 41)
    for rid in ("y", "z", "w"):
        for g in kv.groups:
            table = kv.block_table(rid, g.name)
            n = kv.num_slots(rid)
            positions = np.array([rng.randrange(n) for _ in range(40)] + [0, n - 1])
            got = kv.slot_mapping(rid, g.name, positions)
            assert got.dtype == np.int32
            expected = [table[p // g.tokens_per_page] * g.tokens_per_page + p % g.tokens_per_page
                        for p in positions]
            assert got.tolist() == expected
    # Slots of different requests in one group never collide.
    all_slots = np.concatenate(
        [kv.slot_mapping(r, "mla", np.arange(kv.num_slots(r))) for r in ("y", "z", "w")]
    )
    assert len(set(all_slots.tolist())) == all_slots.size
    with pytest.raises(ValueError):
        kv.slot_mapping("y", "mla", np.array([kv.num_slots("y") + 100]))
    with pytest.raises(ValueError):
        kv.slot_mapping("y", "mla", np.array([-1]))
    assert kv.audit() == []


def test_block_table_array_pads_with_null():
    _, kv = make()
    kv.allocate_slots("a", 9)
    kv.allocate_slots("b", 1)
    arr = kv.block_table_array(["b", None, "a"], "mla", 4)
    assert arr.dtype == np.int32 and arr.shape == (3, 4)
    assert arr[0].tolist() == kv.block_table("b", "mla") + [0, 0, 0]
    assert arr[1].tolist() == [0, 0, 0, 0]
    assert arr[2].tolist() == kv.block_table("a", "mla") + [0]
    with pytest.raises(ValueError):
        kv.block_table_array(["a"], "mla", 2)


def test_free_returns_everything_tail_first():
    pool, kv = make(num_blocks=33)
    kv.allocate_slots("a", 10)
    kv.allocate_slots("b", 6)
    tables = {g.name: kv.block_table("a", g.name) for g in kv.groups}
    kv.free("a")
    assert not kv.has_request("a")
    tail = pool.free_queue()[-sum(len(t) for t in tables.values()):]
    assert tail == [b for g in kv.groups for b in reversed(tables[g.name])]
    kv.free("b")
    kv.free("never-seen")  # no-op
    assert pool.num_free == pool.num_usable_blocks and pool.usage() == 0.0
    assert kv.audit() == []


def test_caps():
    _, kv = make(caps={"mla": 3})
    assert kv.max_tokens_per_request() == 12
    assert kv.allocate_slots("a", 12)
    with pytest.raises(ValueError, match="max_blocks_per_request"):
        kv.allocate_slots("a", 13)
    with pytest.raises(ValueError):
        make(caps={"nope": 3})


def test_release_revive_and_reuse_callback():
    pool, kv = make(num_blocks=7, on_reuse=True, mtp=False)
    kv.allocate_slots("a", 8)  # 2 mla + 1 indexer = 3 pages; 3 free
    mla = kv.block_table("a", "mla")
    b0 = kv.release_page("a", "mla", 0)
    assert b0 == mla[0] and pool.is_free(b0)
    assert pool.get_tag(b0) == ReleasedPageTag("a", "mla", 0)
    assert kv.block_table("a", "mla") == mla  # still readable
    assert kv.slot_mapping("a", "mla", np.array([1])).tolist() == [mla[0] * 4 + 1]
    assert kv.audit() == []
    assert kv.revive_page("a", "mla", 0)  # intact: taken back
    assert pool.refcount(b0) == 1 and pool.get_tag(b0) is None
    assert kv.audit() == []
    with pytest.raises(ValueError):
        kv.revive_page("a", "mla", 0)  # not released
    kv.release_page("a", "mla", 0)
    assert kv.allocate_slots("b", 8)  # 2 mla + 1 indexer from the head of the queue
    assert pool.free_queue() == [b0]  # the released page sat at the tail
    assert kv.allocate_slots("b", 12)  # one more mla page: the released one
    assert kv.block_table("b", "mla")[-1] == b0
    assert kv.block_table("a", "mla")[0] == NULL_BLOCK  # the callback marked it lost
    assert kv.table("a", "mla").placeholders == {0}
    assert kv.slot_mapping("a", "mla", np.arange(4)).tolist() == [-1] * 4
    assert kv.audit() == []
    kv.free("a")
    kv.free("b")
    assert pool.num_free == pool.num_usable_blocks
    assert kv.audit() == []


def test_revive_after_reuse_without_callback_turns_into_placeholder():
    pool, kv = make(num_blocks=7, mtp=False)
    kv.allocate_slots("a", 8)
    kv.release_page("a", "mla", 1)
    assert kv.allocate_slots("b", 8) and kv.allocate_slots("b", 12)  # takes every free page
    assert any("not marked lost" in e for e in kv.audit())
    assert not kv.revive_page("a", "mla", 1)
    assert kv.block_table("a", "mla")[1] == NULL_BLOCK
    assert kv.audit() == []


def test_free_clears_tags_of_intact_released_pages():
    seen = []
    pool, kv = make(num_blocks=7, mtp=False)
    pool.on_reuse = lambda b, t: seen.append(t)
    kv.allocate_slots("a", 8)
    kv.release_page("a", "mla", 0)
    kv.free("a")
    pool.allocate(pool.num_free)
    assert seen == []


def test_a_shared_page_is_released_by_all_its_holders_together():
    pool, kv = make(num_blocks=12, on_reuse=True, mtp=False)
    kv.allocate_slots("a", 8)  # 2 mla + 1 indexer
    shared = kv.block_table("a", "mla")
    for r in ("b", "c"):  # prefix-cache hits of both mla pages
        assert kv.allocate_slots(r, 12, {"mla": shared})
    assert pool.refcount(shared[0]) == 3
    with pytest.raises(ValueError, match="shared"):
        kv.release_page("a", "mla", 0)  # one holder alone cannot
    with pytest.raises(ValueError, match="3 holders"):
        kv.release_shared_page({"a": 0, "b": 0}, "mla")
    with pytest.raises(ValueError, match="different blocks"):
        kv.release_shared_page({"a": 0, "b": 1, "c": 0}, "mla")
    free = pool.num_free
    b0 = kv.release_shared_page({"a": 0, "b": 0, "c": 0}, "mla", front=True)
    b1 = kv.release_shared_page({"a": 1, "b": 1, "c": 1}, "mla", front=True)
    assert (b0, b1) == (shared[0], shared[1]) and pool.num_free == free + 2 and pool.refcount(b0) == 0
    assert all(kv.block_table(r, "mla")[:2] == shared for r in "abc")  # still readable in place
    assert kv.audit() == []
    # Reviving by one holder takes the page back for every holder still holding it released.
    assert kv.revive_page("b", "mla", 1)
    assert pool.refcount(b1) == 3 and pool.get_tag(b1) is None
    assert all(kv.table(r, "mla").is_owned(1) for r in "abc")
    assert kv.audit() == []
    # A holder that finishes leaves the tag to the others; the pool's reuse marks them all lost.
    kv.free("a")
    assert pool.get_tag(b0) is not None and kv.audit() == []
    taken = pool.allocate(pool.num_free)
    assert b0 in taken
    for r in "bc":
        assert kv.block_table(r, "mla")[0] == NULL_BLOCK and kv.table(r, "mla").placeholders == {0}
    assert kv.audit(external_refs=dict.fromkeys(taken, 1)) == []


def test_a_shared_release_whose_last_holder_finishes_clears_its_tag():
    seen = []
    pool, kv = make(num_blocks=9, mtp=False)
    pool.on_reuse = lambda b, t: seen.append(t)
    kv.allocate_slots("a", 8)
    assert kv.allocate_slots("b", 8, {"mla": kv.block_table("a", "mla")})
    kv.release_shared_page({"a": 0, "b": 0}, "mla")
    kv.free("a")
    kv.free("b")
    assert kv.audit() == []
    pool.allocate(pool.num_free)
    assert seen == []


def test_placeholders_and_audit_of_stray_null_blocks():
    pool, kv = make()
    kv.append_placeholders("a", "mla", 2)
    kv.append_placeholders("a", "indexer", 0)
    assert kv.allocate_slots("a", 12)  # positions 8..11 need one owned mla page
    table = kv.block_table("a", "mla")
    assert table[:2] == [NULL_BLOCK, NULL_BLOCK] and table[2] != NULL_BLOCK
    assert kv.slot_mapping("a", "mla", np.array([0, 7, 8])).tolist() == [-1, -1, table[2] * 4]
    assert kv.audit() == []
    kv.table("a", "mla").blocks[2] = NULL_BLOCK  # a null entry that is not a placeholder
    errors = kv.audit()
    assert any("without a placeholder" in e for e in errors)
    assert any("refcount 1 but 0 owners" in e for e in errors)  # and its page leaked


def test_audit_detects_double_ownership():
    pool, kv = make()
    kv.allocate_slots("a", 4)
    kv.allocate_slots("b", 4)
    kv.table("b", "mla").blocks[0] = kv.block_table("a", "mla")[0]
    assert any("owners" in e for e in kv.audit())


def test_random_operations_keep_audit_clean():
    rng = random.Random(3)
    pool, kv = make(num_blocks=40, on_reuse=True)
    lens: dict[str, int] = {}
    for step in range(1500):
        op = rng.random()
        if op < 0.5:
            rid = rng.choice(list(lens) + [f"r{step}"])
            new = lens.get(rid, 0) + rng.randint(1, 12)
            if kv.allocate_slots(rid, new):
                lens[rid] = new
        elif op < 0.7 and lens:
            rid = rng.choice(list(lens))
            kv.free(rid)
            del lens[rid]
        elif lens:
            rid = rng.choice(list(lens))
            t = kv.table(rid, "mla")
            owned = [i for i in range(len(t.blocks) - 2) if t.is_owned(i)]
            if owned:
                kv.release_page(rid, "mla", rng.choice(owned))
            if t.released and rng.random() < 0.5:
                kv.revive_page(rid, "mla", rng.choice(list(t.released)))
        assert kv.audit() == []
    for rid in list(lens):
        kv.free(rid)
    assert pool.num_free == pool.num_usable_blocks
    assert kv.audit() == []


def test_copy_from_copies_a_held_page_and_takes_over_a_free_one():
    reused = []
    pool, kv = make(num_blocks=20, mtp=False)
    pool.on_reuse = lambda b, tag: reused.append((b, tag))
    assert kv.allocate_slots("a", 20)  # mla 5 pages, indexer 2
    a_mla, a_idx = kv.block_table("a", "mla"), kv.block_table("a", "indexer")
    # b reuses 8 tokens: two shared mla pages, and indexer page 0 (16 tokens) copied on write.
    assert kv.allocate_slots("b", 12, {"mla": a_mla[:2]}, {"indexer": a_idx[0]})
    b_idx = kv.block_table("b", "indexer")
    assert kv.block_table("b", "mla")[:2] == a_mla[:2] and b_idx[0] != a_idx[0]
    assert kv.take_page_copies() == [(a_idx[0], b_idx[0])] and kv.take_page_copies() == []
    assert pool.refcount(a_idx[0]) == 1 and kv.audit() == []
    # Once nobody holds the source, it is taken over in place (tag dropped through on_reuse).
    pool.set_tag(a_idx[1], "cached")
    kv.free("a")
    free_before = pool.num_free
    assert kv.allocate_slots("c", 30, None, {"indexer": a_idx[1]})
    assert kv.block_table("c", "indexer")[0] == a_idx[1] and kv.take_page_copies() == []
    assert reused == [(a_idx[1], "cached")] and pool.get_tag(a_idx[1]) is None
    assert free_before - pool.num_free == 8 + 2 and kv.audit() == []
    with pytest.raises(ValueError, match="no new page"):
        kv.allocate_slots("d", 0, None, {"indexer": a_idx[0]})
    with pytest.raises(ValueError, match="already has tables"):
        kv.allocate_slots("b", 40, None, {"indexer": a_idx[0]})
