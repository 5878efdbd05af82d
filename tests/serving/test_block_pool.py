"""BlockPool: allocation order, LRU reuse, tags and the reuse callback, revival, invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from serving.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocksError


def test_initial_state_and_null_block_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.num_free == 4
    assert pool.usage() == 0.0
    blocks = pool.allocate(4)
    assert blocks == [1, 2, 3, 4]
    assert NULL_BLOCK not in blocks
    assert pool.num_free == 0 and pool.usage() == 1.0
    assert pool.audit() == []


def test_allocate_takes_from_head_free_appends_to_tail_in_given_order():
    pool = BlockPool(7)
    a = pool.allocate(3)  # 1, 2, 3
    assert pool.free_queue() == [4, 5, 6]
    pool.free(reversed(a))  # tail-first: 3, 2, 1
    assert pool.free_queue() == [4, 5, 6, 3, 2, 1]
    assert pool.allocate(4) == [4, 5, 6, 3]  # least recently freed first, then the tail page
    assert pool.allocate(2) == [2, 1]
    assert pool.audit() == []


def test_lru_reuse_order_across_several_frees():
    pool = BlockPool(5)
    b = pool.allocate(4)
    pool.free([b[2]])
    pool.free([b[0]])
    pool.free([b[3], b[1]])
    assert pool.allocate(4) == [b[2], b[0], b[3], b[1]]


def test_no_free_blocks_allocates_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    before = pool.free_queue()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.free_queue() == before and pool.num_free == 1
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.audit() == []


def test_refcounting_and_double_free():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.refcount(b) == 2
    pool.free([b])
    assert pool.refcount(b) == 1 and not pool.is_free(b)
    pool.free([b])
    assert pool.is_free(b)
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    (c,) = pool.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free([c, c])  # one reference, freed twice: nothing changes
    assert pool.refcount(c) == 1
    with pytest.raises(ValueError):
        pool.free([99])
    assert pool.audit() == []


def test_null_block_is_ignored_by_free_and_incref():
    pool = BlockPool(3)
    pool.free([NULL_BLOCK])
    pool.incref([NULL_BLOCK])
    assert pool.refcount(NULL_BLOCK) == 0
    with pytest.raises(ValueError):
        pool.set_tag(NULL_BLOCK, "x")
    assert pool.audit() == []


def test_reuse_callback_with_tags():
    seen = []
    pool = BlockPool(4, on_reuse=lambda block, tag: seen.append((block, tag, pool.refcount(block))))
    a, b, c = pool.allocate(3)
    pool.set_tag(a, "tag-a")
    pool.set_tag(b, "tag-b")
    pool.free([a, b, c])
    assert pool.get_tag(a) == "tag-a"  # kept while the page sits in the free queue
    assert pool.allocate(1) == [c]  # untagged pages go first: no cached contents lost
    got = pool.allocate(1)
    assert got == [a]
    assert seen == [(a, "tag-a", 1)]  # called before allocate returned, page already owned
    assert pool.get_tag(a) is None  # cleared on reuse
    pool.clear_tag(b)
    pool.allocate(1)  # b (tag cleared): no callback
    assert seen == [(a, "tag-a", 1)]
    assert pool.audit() == []


def test_free_queue_tiers_untagged_then_front_then_tagged():
    pool = BlockPool(8)
    a = pool.allocate(7)
    for b in a[:5]:
        pool.set_tag(b, f"t{b}")
    pool.free([a[0], a[5]])  # tagged (LRU tier), untagged
    pool.free([a[1], a[2]], front=True)  # front tier, in the given order
    pool.free([a[6], a[3]])
    assert pool.free_queue() == [a[5], a[6], a[1], a[2], a[0], a[3]]
    pool.clear_tag(a[0])  # a free page whose contents no longer matter: last of the untagged
    pool.set_tag(a[6], "late")  # a free untagged page that now matters: last of the tagged
    assert pool.free_queue() == [a[5], a[0], a[1], a[2], a[3], a[6]]
    assert pool.allocate(3) == [a[5], a[0], a[1]] and pool.audit() == []


def test_revive_freed_page_via_incref_keeps_contents_and_tag():
    seen = []
    pool = BlockPool(5, on_reuse=lambda block, tag: seen.append(block))
    a, b = pool.allocate(2)
    pool.set_tag(a, "cached")
    pool.free([a, b])
    assert pool.num_free == 4
    pool.incref([a])  # touch it back out of the free queue
    assert pool.refcount(a) == 1 and not pool.is_free(a)
    assert pool.get_tag(a) == "cached"
    assert a not in pool.free_queue()
    assert pool.num_free == 3
    assert a not in pool.allocate(3)
    assert seen == []
    assert pool.audit() == []


def test_audit_detects_corruption():
    pool = BlockPool(4)
    pool.allocate(1)
    pool._refcount[2] = 1  # both free and owned
    pool._refcount[3] = -1
    errors = pool.audit()
    assert any("both free and owned" in e for e in errors)
    assert any("negative" in e for e in errors)
    pool = BlockPool(4)
    del pool._untagged[2]  # neither free nor owned
    assert any("neither free nor owned" in e for e in pool.audit())


def test_random_operations_keep_audit_clean():
    rng = random.Random(0)
    pool = BlockPool(33, on_reuse=lambda b, t: None)
    held: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 6)
            if n <= pool.num_free:
                held += pool.allocate(n)
            else:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(n)
        elif op < 0.7 and held:
            k = rng.randint(1, len(held))
            rng.shuffle(held)
            pool.free(held[:k])
            del held[:k]
        elif op < 0.85:
            b = rng.randint(1, 32)
            pool.incref([b])
            held.append(b)
        elif held:
            pool.set_tag(rng.choice(held), rng.random())
        assert pool.audit() == []
        assert pool.num_free == 32 - len(set(held))


class PoolMachine(RuleBasedStateMachine):
    """Model-based check: refcounts, free-queue order and reuse callbacks against a plain model."""

    NUM_BLOCKS = 9

    @initialize()
    def setup(self):
        self.reused: list[tuple[int, object]] = []
        self.pool = BlockPool(self.NUM_BLOCKS, on_reuse=lambda b, t: self.reused.append((b, t)))
        self.rc = {b: 0 for b in range(1, self.NUM_BLOCKS)}
        self.tiers = {"untagged": list(range(1, self.NUM_BLOCKS)), "front": [], "tagged": []}
        self.tags: dict[int, object] = {}

    @property
    def queue(self):
        return self.tiers["untagged"] + self.tiers["front"] + self.tiers["tagged"]

    def _unqueue(self, b):
        for q in self.tiers.values():
            if b in q:
                q.remove(b)

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        if n > len(self.queue):
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        self.reused.clear()
        got = self.pool.allocate(n)
        expected = self.queue[:n]
        for b in expected:
            self._unqueue(b)
        assert got == expected
        assert self.reused == [(b, self.tags[b]) for b in got if b in self.tags]
        for b in got:
            self.rc[b] = 1
            self.tags.pop(b, None)

    @precondition(lambda self: any(self.rc.values()))
    @rule(data=st.data(), front=st.booleans())
    def free(self, data, front):
        owned = [b for b, c in self.rc.items() for _ in range(c)]
        chosen = data.draw(st.lists(st.sampled_from(owned), min_size=1, max_size=4))
        if any(chosen.count(b) > self.rc[b] for b in chosen):
            with pytest.raises(ValueError):
                self.pool.free(chosen, front=front)
            return
        self.pool.free(chosen, front=front)
        for b in chosen:
            self.rc[b] -= 1
            if self.rc[b] == 0:
                self.tiers["untagged" if b not in self.tags else "front" if front else "tagged"].append(b)

    @rule(b=st.integers(1, NUM_BLOCKS - 1))
    def incref(self, b):
        self.pool.incref([b])
        if self.rc[b] == 0:
            self._unqueue(b)
        self.rc[b] += 1

    @rule(b=st.integers(1, NUM_BLOCKS - 1), tag=st.integers(0, 3))
    def tag(self, b, tag):
        self.pool.set_tag(b, tag)
        self.tags[b] = tag
        if b in self.tiers["untagged"]:
            self.tiers["untagged"].remove(b)
            self.tiers["tagged"].append(b)

    @rule(b=st.integers(1, NUM_BLOCKS - 1))
    def untag(self, b):
        assert self.pool.clear_tag(b) == self.tags.pop(b, None)
        if self.rc[b] == 0 and b not in self.tiers["untagged"]:
            self._unqueue(b)
            self.tiers["untagged"].append(b)

    @invariant()
    def consistent(self):
        assert self.pool.audit() == []
        assert self.pool.free_queue() == self.queue
        assert all(self.pool.refcount(b) == c for b, c in self.rc.items())
        assert all(self.pool.get_tag(b) == self.tags.get(b) for b in self.rc)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_claim_hands_out_one_specific_free_page():
    seen = []
    pool = BlockPool(5, on_reuse=lambda b, t: seen.append((b, t)))
    a = pool.allocate(3)
    pool.set_tag(a[1], "t")
    pool.free(a)
    pool.claim(a[1])
    assert pool.refcount(a[1]) == 1 and seen == [(a[1], "t")] and pool.get_tag(a[1]) is None
    assert a[1] not in pool.free_queue() and pool.audit() == []
    with pytest.raises(ValueError, match="not free"):
        pool.claim(a[1])
