"""Pallas hot-buffer resolver (interpret mode) against the reference, bit for bit, and against the
loop-by-loop model (`hot_resolve_model`); dispatch rules.

Every case has one shape (8 tokens × 6 positions over 4 batch rows of 6 pages of 4 tokens, 4 hot
pages, 6 state rows of width 20), so the kernels compile once; blocks of 8 slots and 4
candidates make every pass span several blocks, a partial last one included (20 = 8 + 8 + 4,
6 = 4 + 2), and slots 16–19 lie beyond the hot table (unusable).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.hot_resolve import api
from kernels.hot_resolve.pallas_triton import hot_resolve_pallas_triton
from kernels.hot_resolve.reference import hot_resolve_reference
from tests.kernels.hot_resolve_model import resolve_model

TPP, B, T, K, P, H, S, M, NHB = 4, 4, 8, 6, 6, 4, 6, 20, 12
NAMES = ("slots", "miss_host_row", "miss_slot", "stats", "host_row", "rank")
KEYS = ("topk", "req", "block_table", "host_table", "hot_table", "state_row", "reset_from", "host_row", "rank")


def _case(rng, *, req=None, resident=0.35, p_hot=0.9, p_state=1.0, corrupt=0.0, empty=0.35):
    """Random inputs: tokens of a row contiguous, pages resident / host-only / nowhere, hot pages
    partly null, state rows partly absent; `corrupt` mixes bad host rows (out of range, the null
    host block, duplicates), garbage ranks and reset_from into the state."""
    if req is None:
        req = np.repeat(np.arange(B), rng.multinomial(T, np.ones(B) / B))
    bt = np.where(rng.random((B, P)) < resident, rng.integers(1, 50, (B, P)), 0)
    ht = np.where(rng.random((B, P)) < 0.85, rng.integers(1, NHB, (B, P)), 0)
    hot = np.where(rng.random((B, H)) < p_hot, rng.integers(1, 50, (B, H)), 0)
    srow = np.where(rng.random(B) < p_state, rng.permutation(S)[:B], -1)
    reset = np.full(B, M)
    host_row = np.where(rng.random((S, M)) < empty, -1, rng.integers(TPP, NHB * TPP, (S, M)))
    rank = np.stack([rng.permutation(M) for _ in range(S)])
    if corrupt:
        ht = np.where(rng.random((B, P)) < corrupt / 4, NHB + rng.integers(0, 3, (B, P)), ht)
        reset = np.where(rng.random(B) < 0.5, rng.integers(0, M + 1, B), reset)
        bad = rng.choice([-5, 0, TPP - 1, NHB * TPP, 2**31 - 1, -2**31], (S, M))
        host_row = np.where(rng.random((S, M)) < corrupt, bad, host_row)
        copied = host_row[np.arange(S)[:, None], rng.integers(0, M, (S, M))]
        host_row = np.where(rng.random((S, M)) < corrupt, copied, host_row)
        rank[:S // 2] = rng.integers(-3, M + 3, (S // 2, M))
        rank[0, :3] = [2**31 - 1, -2**31, 0]
    pool = rng.integers(-1, P * TPP + 3, (B, 2 * K))  # repeats within a row; pages ≥ P: out of range
    topk = np.stack([rng.choice(pool[r], K) for r in req])
    arrays = (topk, req, bt, ht, hot, srow, reset, host_row, rank)
    return {k: np.asarray(v, np.int32) for k, v in zip(KEYS, arrays)}


def _args(case):
    return [jnp.asarray(case[k]) for k in KEYS] + [NHB]


def _resolve(case):
    """Pallas (interpret) and reference outputs, asserted bit-identical; → numpy outputs."""
    args = _args(case)
    pal = hot_resolve_pallas_triton(*args, tokens_per_page=TPP, block_m=8, block_c=4, interpret=True)
    ref = hot_resolve_reference(*args, tokens_per_page=TPP)
    for name, p, r in zip(NAMES, pal, ref):
        assert p.dtype == r.dtype and p.shape == r.shape, name
        np.testing.assert_array_equal(np.asarray(p), np.asarray(r), err_msg=name)
    return tuple(np.asarray(x) for x in pal)


def _next(case, out, **changes):
    """The case one step later: the returned state fed back."""
    return {**case, "host_row": out[4], "rank": out[5], **changes}


def _copies(out):
    n = int(out[3][1])
    assert np.all(out[1][n:] == -1) and np.all(out[2][n:] == -1) and np.all(out[2][:n] >= 0)
    return list(zip(out[1][:n].tolist(), out[2][:n].tolist()))


def test_cold_start_then_fixed_point(rng):
    case = _case(rng, empty=1.0, p_hot=1.0)
    out = _resolve(case)
    hits, misses, dropped = out[3]
    assert hits == 0 and misses > 0 and dropped == 0
    assert len(_copies(out)) == misses
    again = _resolve(_next(case, out))  # the same top-k once more: all hits, state unchanged
    assert tuple(again[3]) == (misses, 0, 0)
    np.testing.assert_array_equal(again[0], out[0])
    np.testing.assert_array_equal(again[4], out[4])
    np.testing.assert_array_equal(again[5], out[5])


def test_several_query_rows_per_request(rng):
    """Three and four query rows share one plan: one copy per distinct host row of the request
    (the requests' host blocks are disjoint here, so no host row repeats in the miss list)."""
    req = np.array([0, 0, 0, 1, 2, 2, 2, 2])
    case = _case(rng, req=req, empty=1.0, p_hot=1.0, resident=0.2)
    case["topk"][1] = case["topk"][0][::-1]  # the same positions, other order
    case["host_table"] = (1 + 3 * np.arange(B)[:, None] + rng.integers(0, 3, (B, P))).astype(np.int32)  # disjoint
    out = _resolve(case)
    rows = [h for h, _ in _copies(out)]
    assert len(rows) == len(set(rows))
    for step in range(2):  # a speculative step later: part of the top-k changes
        topk = case["topk"].copy()
        changed = rng.random(topk.shape) < 0.4
        topk[changed] = rng.integers(0, P * TPP, changed.sum())
        case = _next(case, out, topk=topk)
        out = _resolve(case)


def test_padding_rows_write_nothing(rng):
    """Padding tokens at the end point at the last batch row (as the runner pads), which has no
    state; another row has no hot lease either."""
    req = np.array([0, 0, 1, 2, 3, 3, 3, 3])
    case = _case(rng, req=req)
    case["state_row"][[1, 3]] = -1
    out = _resolve(case)
    mask = np.isin(case["req"], [1, 3])[:, None] & (case["topk"] >= 0)
    page = np.clip(case["topk"], 0, None) // TPP
    rows = case["req"][:, None].repeat(K, 1)
    resident = (page < P) & (case["block_table"][rows, np.minimum(page, P - 1)] > 0)
    assert np.all(out[0][mask & ~resident] == -1)
    untouched = np.setdiff1d(np.arange(S), case["state_row"][[0, 2]])
    np.testing.assert_array_equal(out[4][untouched], case["host_row"][untouched])
    np.testing.assert_array_equal(out[5][untouched], case["rank"][untouched])


def test_corrupted_state(rng):
    """Out-of-range host rows, the null host block, duplicated host rows, garbage ranks (extremes
    and repeats), reset_from inside the state, host blocks beyond the pool."""
    for _ in range(3):
        case = _case(rng, corrupt=0.25)
        out = _resolve(case)
        _resolve(_next(case, out))
    # Targeted: host rows 20..23 (host block 5, page 0 of row 0) selected by row 0's first token.
    case = _case(rng, req=np.array([0, 0, 1, 1, 2, 2, 3, 3]), resident=0.0, p_hot=1.0, empty=1.0)
    case["topk"][0] = [0, 1, 2, 3, -1, 0]
    case["host_table"][0, 0] = 5
    s = case["state_row"][0]
    case["host_row"][s, [0, 1, 2, 3, 5, 9]] = [20, 20, 21, 2, 22, 23]  # 20 twice; 2: null host block
    case["reset_from"][0] = 5  # slots 5… cleared: 22 and 23 are gone
    out = _resolve(case)
    assert out[0][0, 1] == case["hot_table"][0, 0] * TPP + 2  # 21: a hit in slot 2
    assert out[1][:3].tolist() == [20, 22, 23]  # the duplicated and the cleared rows are copied again


def test_partly_null_hot_pages(rng):
    case = _case(rng, p_hot=0.5)
    case["hot_table"][0] = [0, 7, 0, 9]
    out = _resolve(case)
    assert np.all((out[0] == -1) | (out[0] >= TPP))  # never a slot of the null block 0


def test_misses_beyond_evictable_slots_are_dropped(rng):
    case = _case(rng, empty=1.0, resident=0.0, p_hot=0.0)
    case["hot_table"][:, 0] = np.arange(1, B + 1)  # one hot page: 4 slots per row
    out = _resolve(case)
    assert out[3][2] > 0 and out[3][1] <= 4 * B
    _resolve(_next(case, out))


@pytest.mark.parametrize("seed", range(4))
def test_random_steps(seed):
    rng = np.random.default_rng(100 + seed)
    case = _case(rng, corrupt=0.1 if seed % 2 else 0.0, p_hot=0.6 if seed == 3 else 0.9, p_state=0.8)
    for _ in range(3):
        out = _resolve(case)
        topk = case["topk"].copy()
        changed = rng.random(topk.shape) < 0.3
        topk[changed] = rng.integers(-1, P * TPP + 3, changed.sum())
        case = _next(case, out, topk=topk)


def test_matches_loop_model(rng):
    case = _case(rng, corrupt=0.1, p_state=0.8)
    out = _resolve(case)
    slots, copies, stats, host_row, rank = resolve_model(*[case[k] for k in KEYS], NHB, TPP)
    np.testing.assert_array_equal(out[0], slots)
    assert _copies(out) == copies
    assert tuple(out[3]) == stats
    np.testing.assert_array_equal(out[4], host_row)
    np.testing.assert_array_equal(out[5], rank)


def test_dispatch(rng, monkeypatch):
    case = _case(rng)
    args = _args(case)
    assert api.default_implementation() == ("pallas_triton" if jax.default_backend() == "gpu" else "xla")
    ref = hot_resolve_reference(*args, tokens_per_page=TPP)
    for kw in ({}, {"interpret": True}, {"implementation": "xla"}):
        for a, b in zip(api.hot_resolve(*args, tokens_per_page=TPP, **kw), ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(KeyError):
        api.hot_resolve(*args, tokens_per_page=TPP, implementation="cuda")
    with pytest.raises(NotImplementedError, match="powers of two"):
        hot_resolve_pallas_triton(*args, tokens_per_page=TPP, block_m=3, interpret=True)
    # A configuration the kernels refuse: explicit use raises, the default falls back.
    monkeypatch.setattr(api, "unsupported_reason", lambda *a, **k: "refused")
    monkeypatch.setitem(api.IMPLEMENTATIONS, "pallas_triton",
                        functools.partial(hot_resolve_pallas_triton, block_m=3))
    with pytest.raises(NotImplementedError):
        api.hot_resolve(*args, tokens_per_page=TPP, implementation="pallas_triton", interpret=True)
    for a, b in zip(api.hot_resolve(*args, tokens_per_page=TPP, interpret=True), ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
