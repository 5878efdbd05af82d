"""The hot-buffer resolver's contract (kernels/hot_resolve/reference.py) against a loop-by-loop
model (tests/kernels/hot_resolve_model.py) and against explicit expectations: cold start fills
slots in exact LRU order, re-resolving is a fixed point, padding rows and rows without state touch
nothing, corrupted state never yields a wrong row, several query rows share one plan, and the slots
and copies read back byte-exact rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.hot_resolve.reference import dropped_selections, hot_resolve_reference
from tests.kernels.hot_resolve_model import resolve_model

TPP = 4


def resolve(*arrays, num_host_blocks, tpp=TPP):
    out = hot_resolve_reference(*(jnp.asarray(a) for a in arrays), num_host_blocks, tokens_per_page=tpp)
    slots, mh, ms, stats, st, rk = (np.asarray(x) for x in out)
    n = int((mh >= 0).sum())
    assert (mh[n:] == -1).all() and (ms[n:] == -1).all()  # valid entries first
    return slots, list(zip(mh[:n].tolist(), ms[:n].tolist())), tuple(stats.tolist()), st, rk


def fresh_state(S, M, rng=None):
    rank = np.tile(np.arange(M, dtype=np.int32), (S, 1)) if rng is None else \
        np.stack([rng.permutation(M) for _ in range(S)]).astype(np.int32)
    return np.full((S, M), -1, np.int32), rank


def one_request(topk, host_pages, resident=None, hot_pages=(30, 31), P=6):
    """Arrays for one request (batch row 0) plus the padding row 1."""
    T = len(topk)
    bt = np.zeros((2, P), np.int32)
    for i, b in (resident or {}).items():
        bt[0, i] = b
    ht = np.zeros((2, P), np.int32)
    ht[0, : len(host_pages)] = host_pages
    hot = np.zeros((2, max(2, len(hot_pages))), np.int32)
    hot[0, : len(hot_pages)] = hot_pages
    return (np.asarray(topk, np.int32), np.zeros(T, np.int32), bt, ht, hot, np.array([0, -1], np.int32),
            np.array([0, 0], np.int32))  # reset_from 0: a new state row


def test_cold_start_fills_slots_in_lru_order_and_reads_in_place_what_is_resident():
    rng = np.random.default_rng(0)
    st, rk = fresh_state(1, 8, rng)
    # pages 0..3 on the host (blocks 5..8), page 1 also resident (block 12); positions across pages
    topk = [[13, 2, 5, 14, -1, 0, 9, 2]]
    args = one_request(topk, [5, 6, 7, 8], resident={1: 12})
    slots, copies, stats, st2, rk2 = resolve(*args[:7], st, rk, num_host_blocks=10)
    order = np.argsort(rk[0], kind="stable")  # LRU first
    hot_slot = lambda j: (30 if j < 4 else 31) * TPP + j % TPP  # noqa: E731
    # distinct host rows in first-occurrence order: pos 13, 2, 14, 0, 9 (5 is resident: block 12)
    rows = [8 * TPP + 1, 5 * TPP + 2, 8 * TPP + 2, 5 * TPP + 0, 7 * TPP + 1]
    want_j = {h: int(order[i]) for i, h in enumerate(rows)}
    assert copies == [(h, hot_slot(want_j[h])) for h in rows]
    assert slots[0, 2] == 12 * TPP + 1 and slots[0, 4] == -1
    assert slots[0, 1] == slots[0, 7] == hot_slot(want_j[5 * TPP + 2])  # one copy, both reads
    assert stats == (0, 5, 0)
    assert {int(st2[0, j]) for j in order[:5]} == set(rows) and (st2[0, order[5:]] == -1).all()
    # LRU order after the step: untouched (oldest first), then the misses in miss order.
    assert list(np.argsort(rk2[0])) == list(order[5:]) + list(order[:5])
    model = resolve_model(np.asarray(topk), *args[1:7], st, rk, 10, TPP)
    assert (slots == model[0]).all() and copies == model[1] and stats == model[2]


def test_resolving_the_same_topk_again_is_a_fixed_point():
    rng = np.random.default_rng(1)
    st, rk = fresh_state(1, 8, rng)
    topk = [[13, 2, 5, 14, 0, 9]]
    args = one_request(topk, [5, 6, 7, 8])
    slots, copies, stats, st2, rk2 = resolve(*args[:7], st, rk, num_host_blocks=10)
    no_reset = list(args[:6]) + [np.array([8, 8], np.int32)]  # reset_from = M: nothing stale
    slots3, copies3, stats3, st3, rk3 = resolve(*no_reset, st2, rk2, num_host_blocks=10)
    assert copies3 == [] and stats3 == (6, 0, 0)
    assert (slots3 == slots).all() and (st3 == st2).all() and (rk3 == rk2).all()
    # A reset (new owner of the state row) forgets everything: all misses again.
    _, copies4, stats4, _, _ = resolve(*args[:7], st2, rk2, num_host_blocks=10)
    assert stats4 == (0, 6, 0) and len(copies4) == 6


def test_lru_evicts_the_least_recently_used_and_keeps_hits():
    st, rk = fresh_state(1, 4)  # 4 slots, ranks 0..3
    args = one_request([[0, 1, 2, 3]], [5, 6])  # 4 distinct host rows fill the 4 slots
    _, _, stats, st, rk = resolve(*args[:7], st, rk, num_host_blocks=10)
    assert stats == (0, 4, 0)
    keep = list(args[:6]) + [np.array([4, 4], np.int32)]
    # positions 2, 3 hit; 4, 5 miss and evict the slots of 0 and 1 (least recently used)
    keep[0] = np.array([[2, 3, 4, 5]], np.int32)
    slots, copies, stats, st2, rk2 = resolve(*keep, st, rk, num_host_blocks=10)
    assert stats == (2, 2, 0)
    j_of = {int(h): j for j, h in enumerate(st[0])}
    assert sorted(j for _, j in [(h, s % TPP) for h, s in copies]) == sorted([j_of[5 * TPP], j_of[5 * TPP + 1]])
    # new order: misses, then hits (the untaken evictable set is empty)
    assert list(np.argsort(rk2[0]))[:2] == [s % TPP for _, s in copies]


def test_padding_rows_and_rows_without_state_leave_everything_untouched():
    rng = np.random.default_rng(2)
    st = rng.integers(-1, 40, (3, 8)).astype(np.int32)
    rk = rng.integers(0, 8, (3, 8)).astype(np.int32)
    topk = np.array([[1, 2, 6], [0, 5, 9]], np.int32)
    req = np.array([0, 1], np.int32)  # row 0: no state; row 1: the padding row (no state either)
    bt = np.zeros((2, 4), np.int32)
    ht = np.full((2, 4), 5, np.int32)
    hot = np.full((2, 2), 30, np.int32)
    srow = np.array([-1, -1], np.int32)
    slots, copies, stats, st2, rk2 = resolve(topk, req, bt, ht, hot, srow, np.zeros(2, np.int32), st, rk,
                                             num_host_blocks=10)
    assert (slots == -1).all() and copies == [] and stats == (0, 0, 0)
    assert (st2 == st).all() and (rk2 == rk).all()


def test_corrupted_state_never_yields_a_wrong_row():
    """Out-of-range host rows, rows of the null block, duplicates and garbage ranks: every slot a
    selected position resolves to holds (after the copies) exactly that position's host row."""
    rng = np.random.default_rng(3)
    for trial in range(30):
        M = 8
        st = rng.integers(-5, 60, (2, M)).astype(np.int32)
        st[0, :2] = st[0, 2]  # duplicates
        rk = rng.integers(-100, 100, (2, M)).astype(np.int32)
        topk = rng.integers(-1, 24, (3, 5)).astype(np.int32)
        req = np.array([0, 0, 1], np.int32)
        bt = np.zeros((2, 6), np.int32)
        bt[0, 2] = 20
        ht = rng.integers(1, 12, (2, 6)).astype(np.int32)
        hot = np.array([[30, 31], [32, 0]], np.int32)
        srow = np.array([1, 0], np.int32)
        reset = np.array([rng.integers(0, 9), M], np.int32)
        # the arena's hot slots hold what the (possibly corrupted) state claims
        arena = {}
        for b, s in ((0, 1), (1, 0)):
            for j in range(M):
                if hot[b, j // TPP] > 0:
                    arena[hot[b, j // TPP] * TPP + j % TPP] = int(st[s, j])
        slots, copies, stats, _, _ = resolve(topk, req, bt, ht, hot, srow, reset, st, rk, num_host_blocks=12)
        for h, s in copies:
            arena[s] = h
        for t in range(3):
            b = req[t]
            for k in range(5):
                p = topk[t, k]
                if p < 0 or slots[t, k] < 0:
                    continue
                if bt[b, p // TPP] > 0:
                    assert slots[t, k] == bt[b, p // TPP] * TPP + p % TPP
                else:
                    assert arena[int(slots[t, k])] == ht[b, p // TPP] * TPP + p % TPP, (trial, t, k)


def test_several_query_rows_of_a_request_share_one_plan():
    st, rk = fresh_state(1, 16)
    topk = [[0, 1, 5], [1, 5, 9], [9, 0, 2]]  # host rows repeat across rows
    args = one_request(topk, [5, 6, 7], hot_pages=(30, 31, 32, 33), P=4)
    slots, copies, stats, _, _ = resolve(*args, st, rk, num_host_blocks=10)
    assert stats == (0, 5, 0) and len(copies) == 5  # 0, 1, 5, 9, 2: five distinct rows, one copy each
    assert slots[0, 1] == slots[1, 0] and slots[0, 2] == slots[1, 1] and slots[1, 2] == slots[2, 0]
    assert len({int(s) for s in slots.ravel()}) == 5


def test_misses_beyond_the_evictable_slots_are_dropped_not_misplaced():
    st, rk = fresh_state(1, 4)
    args = one_request([[0, 1, 2, 3, 4, 5]], [5, 6], hot_pages=(30,))
    slots, copies, stats, _, _ = resolve(*args[:7], st, rk, num_host_blocks=10)
    assert stats == (0, 4, 2) and len(copies) == 4
    assert (slots[0, 4:] == -1).all() and len(set(slots[0, :4].tolist())) == 4


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_the_model(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(25):
        B, P, H, S, M, K = 4, 6, 3, 5, 12, 5
        req = np.repeat(np.arange(B), rng.integers(1, 4, B)).astype(np.int32)
        T = len(req)
        topk = rng.integers(-1, P * TPP + 2, (T, K)).astype(np.int32)
        bt = np.where(rng.random((B, P)) < 0.4, rng.integers(1, 30, (B, P)), 0).astype(np.int32)
        ht = np.where(rng.random((B, P)) < 0.8, rng.integers(0, 10, (B, P)), 0).astype(np.int32)
        hot = np.where(rng.random((B, H)) < 0.8, rng.integers(30, 40, (B, H)), 0).astype(np.int32)
        srow = rng.permutation(S)[:B].astype(np.int32)
        srow[rng.random(B) < 0.2] = -1
        reset = rng.choice([0, 3, M, 100], B).astype(np.int32)
        st = rng.integers(-3, 45, (S, M)).astype(np.int32)
        rk = rng.integers(-5, 20, (S, M)).astype(np.int32)
        got = resolve(topk, req, bt, ht, hot, srow, reset, st, rk, num_host_blocks=9)
        want = resolve_model(topk, req, bt, ht, hot, srow, reset, st, rk, 9, TPP)
        assert (got[0] == want[0]).all() and got[1] == want[1] and got[2] == want[2]
        assert (got[3] == want[3]).all() and (got[4] == want[4]).all()


def test_query_rows_before_the_first_dropped_selection_are_fully_resolved():
    """Adaptive prefill sizing keeps a chunk up to its first query row with a dropped selection
    (serving/hisparse/truncation.py). On random chunks far too wide for their hot buffer:
    `dropped_selections` marks exactly the selections that needed the hot buffer and got no slot
    (as many distinct host rows as the resolver's `dropped` count); every query row before a batch
    row's first marked one resolved all of its selections; and each of those slots holds, after
    the copies, exactly the selected position's host row."""
    rng = np.random.default_rng(11)
    seen_drops = 0
    for trial in range(40):
        B, P, H, S, K, nhb = 2, 8, 2, 3, 6, 40
        M = H * TPP
        req = np.repeat(np.arange(B), 5).astype(np.int32)  # one shape: the resolver compiles once
        T = len(req)
        topk = rng.integers(-1, P * TPP, (T, K)).astype(np.int32)
        bt = np.where(rng.random((B, P)) < 0.3, rng.integers(1, 30, (B, P)), 0).astype(np.int32)
        ht = rng.integers(1, nhb, (B, P)).astype(np.int32)
        hot = (30 + rng.permutation(10)[: B * H]).reshape(B, H).astype(np.int32)  # distinct hot pages
        srow = np.array([2, 0], np.int32)
        st, rk = fresh_state(S, M, rng)
        reset = np.array([0, 0], np.int32)
        slots, copies, stats, _, _ = resolve(topk, req, bt, ht, hot, srow, reset, st, rk, num_host_blocks=nhb)
        dropped = np.asarray(dropped_selections(jnp.asarray(topk), jnp.asarray(req), jnp.asarray(bt), jnp.asarray(ht),
                                                jnp.asarray(srow), S, nhb, jnp.asarray(slots), tokens_per_page=TPP))
        rows = {(int(req[t]), int(ht[req[t], topk[t, k] // TPP]) * TPP + int(topk[t, k]) % TPP)
                for t, k in zip(*np.nonzero(dropped))}
        assert len(rows) == stats[2], trial
        seen_drops += stats[2] > 0
        arena = {s: h for h, s in copies}
        for b in range(B):
            toks = np.nonzero(req == b)[0]
            marked = [t for t in toks if dropped[t].any()]
            for t in toks[: toks.tolist().index(marked[0])] if marked else toks:
                for k in range(K):
                    p = int(topk[t, k])
                    if p < 0 or bt[b, p // TPP] > 0:
                        continue
                    assert slots[t, k] >= 0 and arena[int(slots[t, k])] == ht[b, p // TPP] * TPP + p % TPP
    assert seen_drops > 20  # the buffers really overflowed


def test_eviction_order_counting_sort_equals_the_comparison_sort():
    """The eviction order (class, rank, index) by counting when every rank row is a permutation,
    by comparison otherwise: both against numpy's lexicographic sort, rows with repeated classes."""
    from kernels.hot_resolve.reference import _order_by_class_and_rank

    rng = np.random.default_rng(5)
    for garbage in (False, True):
        cls = rng.integers(0, 6, (3, 40)).astype(np.int32)
        rank = np.stack([rng.permutation(40) for _ in range(3)]).astype(np.int32)
        if garbage:
            rank[1] = rng.integers(-3, 45, 40)  # repeats and out-of-range values
        got = np.asarray(_order_by_class_and_rank(jnp.asarray(cls), jnp.asarray(rank), num_classes=6))
        for b in range(3):
            want = sorted(range(40), key=lambda j: (cls[b, j], rank[b, j], j))
            assert got[b].tolist() == want, (garbage, b)
