"""HiSparse hot-buffer resolver — pure-JAX reference (the CPU path and the oracle).

The indexer picks, for every query token, K request-local positions. Under Hybrid HiSparse some
of a request's MLA pages are no longer on the device: their rows live in a host pool and are
read through a small per-request *hot buffer* of device rows (docs/design.md §6.1). This op maps every
selected position to the arena slot sparse MLA must read, and plans the host → hot row copies.

For query token t of batch row b = req_idx[t] and selected position p = topk[t, k] (page
i = p // tpp, offset o = p % tpp):

* p < 0 or i ≥ P                         → slot −1 (no entry);
* resident (block_table[b, i] > 0)       → slot block_table[b, i]·tpp + o, read in place;
* host copy (host_table[b, i] > 0) and b has hot state (state_row[b] ≥ 0):
  host row h = host_table[b, i]·tpp + o, then
    - hot hit: a hot slot j of b already holds h → slot hot_slot(b, j);
    - miss: h takes one evictable slot j (below) and the copy (h → hot_slot(b, j)) is emitted;
* otherwise (no page anywhere, or no hot state)  → slot −1.

Hot slots. Slot j ∈ [0, M) of batch row b lives in hot page hot_table[b, j // tpp] at offset
j % tpp: `hot_slot(b, j) = hot_table[b, j // tpp]·tpp + j % tpp`, in the same slot space as the
resident pages (the hot pages are ordinary arena pages). A slot whose page entry is 0 (or beyond
the table) is unusable. The per-request state of one index group is two int32 rows of width M:
`host_row[j]` (the host row slot j holds, −1 empty) and `rank[j]` (its LRU rank, 0 = least
recently used), stored per *state row* (`state_row[b]`), and updated in the returned arrays.

Per batch row and step:

1. Validate the state: slots j ≥ reset_from[b] are cleared (a new owner of the state row, or
   hot pages that changed; their ranks are kept); an entry is dropped (treated as empty) when its
   slot is unusable, its host row is out of range ([tpp, num_host_blocks·tpp): host block 0 is
   the null block) or another entry that passed these checks claims the same host row
   (corrupted state never yields a wrong row).
2. The distinct host rows the request's tokens select (all of its query rows together, so
   several query rows per request — speculative verification, prefill chunks — share one
   plan) are hits or misses.
3. Evictable slots: usable slots that are not hit this step, ordered empty slots first, then by
   rank, then by index. Misses, in order of first occurrence (query row, then top-k order), take
   the evictable slots in that order. A miss with no evictable slot left gets slot −1 (the
   caller's sizing rule, rows·K ≤ usable slots, makes this impossible; `dropped` counts it).
4. New LRU order: the evictable slots that were not taken (in their order), then the new misses
   (in miss order), then the hits (in their old order), then the unusable slots. `rank[j]` is
   the new position of j. Re-resolving the same top-k is a fixed point: all hits, state
   unchanged.

Batch rows with state_row −1 or ≥ S (padding, requests without hot state) emit −1 for
non-resident positions and leave every state row untouched; state rows no batch row names are
untouched. Ranks are never checked: any values give some total order (ties broken by index), and
the new ranks are always a permutation.

Caller contract (undefined otherwise, and implementations may differ): the tokens of one batch
row are contiguous (the `ForwardBatch` contract), `req_idx` lies in [0, B), and no two batch rows
name the same state row.

Stats `[hits, misses, dropped]`: distinct (request, host row) lookups found hot, copied, and
dropped for want of a slot; hits + misses + dropped = lookups.

Implementation: each batch row's state entries are sorted by host row (which also finds the
duplicates); each selection binary-searches its row's sorted state (a hit when found); a stable
sort of the selections by (batch row, host row) groups each distinct (request, host row), its
first element the first occurrence. Peak temporaries O(B·M + T·K).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_BIG = jnp.iinfo(jnp.int32).max


def _divmod(x, d: int):
    """`(x // d, x % d)` for int32 `x` ≥ 0 and a positive static `d`, as truncating division.

    (jnp's `//` and `%` on signed integers add sign corrections to every use; the resolver divides
    only non-negative positions and slot indices. Without them, and with the binary search below as
    a loop, a HiSparse hot step program compiles about a quarter faster on XLA:CPU:
    `scripts/probe_hot_compile.py`, docs/test_suite.md.)"""
    return lax.div(x, jnp.int32(d)), lax.rem(x, jnp.int32(d))


def _seg_first(flags):
    """Index of the start of the run each element belongs to (flags mark run starts)."""
    idx = jnp.arange(flags.shape[0], dtype=jnp.int32)
    return lax.cummax(jnp.where(flags, idx, 0), axis=0)


def _order_by_class_and_rank(cls_BM, rank_BM, num_classes: int):
    """int32 `[B, M]`: each row's indices j ordered by (class, rank, j) ascending.

    The resolver writes every state row's ranks as a permutation of [0, M): then the order is a
    counting sort (slots in rank order, placed after the slots of lower classes), with no
    comparison sort. Rows whose ranks are not a permutation (a corrupted state; the contract
    allows any values) take the comparison sort, which gives the same order where both apply."""
    B, M = rank_BM.shape
    j_BM = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))
    b_BM = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, M))
    in_range = (rank_BM >= 0) & (rank_BM < M)
    r = jnp.where(in_range, rank_BM, M)
    seen = jnp.zeros((B, M), jnp.int32).at[b_BM, r].add(1, mode="drop")
    is_perm = jnp.all(in_range) & jnp.all(seen == 1)

    def counting(_):
        by_rank = jnp.zeros((B, M), jnp.int32).at[b_BM, r].set(j_BM, mode="drop")  # rank → slot
        c = jnp.take_along_axis(cls_BM, by_rank, axis=1)  # class of each rank's slot
        onehot = c[..., None] == jnp.arange(num_classes, dtype=c.dtype)  # [B, M, C]
        before = jnp.cumsum(onehot, axis=1, dtype=jnp.int32)  # same-class slots up to this rank
        offset = jnp.cumsum(before[:, -1], axis=1, dtype=jnp.int32) - before[:, -1]  # slots of lower classes
        dest = jnp.take_along_axis(offset, c, axis=1) + jnp.take_along_axis(before, c[..., None], axis=2)[..., 0] - 1
        return jnp.zeros((B, M), jnp.int32).at[b_BM, dest].set(by_rank)

    def comparison(_):
        return lax.sort((cls_BM, rank_BM, j_BM), dimension=1, num_keys=2, is_stable=True)[2]

    return lax.cond(is_perm, counting, comparison, None)


def _find_in_rows(srt_BM, srt_j_BM, dropped_BM, b_N, key_N):
    """Binary search of each `key_N[n]` in row `b_N[n]` of `srt_BM` (each row ascending):
    `(found, j)` — found when an entry equal to the key that is not `dropped` exists, j its
    `srt_j_BM` value (the slot index)."""
    M = srt_BM.shape[1]

    def halve(_, lo_hi):  # the first entry ≥ key: [lo, hi) halves each round
        lo, hi = lo_hi
        mid = lax.shift_right_logical(lo + hi, 1)  # (lo + hi) // 2, both ≥ 0
        less = (mid < hi) & (srt_BM[b_N, jnp.minimum(mid, M - 1)] < key_N)
        return jnp.where(less, mid + 1, lo), jnp.where(less, hi, mid)

    # (A loop rather than unrolled rounds: one copy of the round in the program to compile.)
    lo, _ = lax.fori_loop(0, max(1, M).bit_length(), halve, (jnp.zeros_like(key_N), jnp.full_like(key_N, M)))
    i = jnp.minimum(lo, M - 1)
    found = (lo < M) & (srt_BM[b_N, i] == key_N) & ~dropped_BM[b_N, i]
    return found, srt_j_BM[b_N, i]


def _lookup(pos, b, block_table_BP, host_table_BP, state_row_B, num_state_rows, num_host_rows, tpp: int):
    """Per selected position `pos` of batch row `b` (same shape): (offset in its page, resident
    block, host block, resident?, needs the hot buffer?) — the resolver's first rule set above."""
    P = block_table_BP.shape[1]
    page, offset = _divmod(jnp.clip(pos, 0), tpp)
    in_range = (pos >= 0) & (page < P)
    page = jnp.minimum(page, P - 1)
    res_block = block_table_BP[b, page]
    host_block = host_table_BP[b, page]
    resident = in_range & (res_block > 0)
    srow = state_row_B.astype(jnp.int32)[b]
    has_state = (srow >= 0) & (srow < num_state_rows)
    need = in_range & ~resident & (host_block > 0) & (host_block * tpp < num_host_rows) & has_state
    return offset, res_block, host_block, resident, need


@functools.partial(jax.jit, static_argnames=("tokens_per_page",))
def hot_resolve_reference(
    topk_TK: jax.Array,
    req_idx_T: jax.Array,
    block_table_BP: jax.Array,
    host_table_BP: jax.Array,
    hot_table_BH: jax.Array,
    state_row_B: jax.Array,
    reset_from_B: jax.Array,
    host_row_SM: jax.Array,
    rank_SM: jax.Array,
    num_host_blocks: jax.Array | int,
    *,
    tokens_per_page: int,
):
    """Resolve selected positions to arena slots through resident pages and the hot buffer.

    Args:
      topk_TK: int32 `[T, K]` request-local positions (−1 = none).
      req_idx_T: int32 `[T]` batch row of each token (tokens of a row contiguous).
      block_table_BP: int32 `[B, P]` resident MLA pages (0 = not on the device).
      host_table_BP: int32 `[B, P]` host-pool block of each page (0 = none).
      hot_table_BH: int32 `[B, H]` hot-lease pages (0 = none); slot j ↔ page j // tpp.
      state_row_B: int32 `[B]` the batch row's state row (−1 = no hot state).
      reset_from_B: int32 `[B]` slots j ≥ this are cleared before resolving (≥ M: none).
      host_row_SM, rank_SM: int32 `[S, M]` hot state of one index group (module docstring).
      num_host_blocks: host-pool blocks (host rows are < num_host_blocks·tpp).
      tokens_per_page: tpp of the MLA group (resident, host and hot pages alike).

    Returns:
      slots_TK int32 `[T, K]` (−1 = none); miss_host_row_X, miss_slot_X int32 `[T·K]`: the
      copies to run (host row → arena slot), valid entries first in miss order, −1 padding;
      stats int32 `[3]` (hits, misses, dropped); new host_row_SM, rank_SM.
    """
    tpp = tokens_per_page
    T, K = topk_TK.shape
    B = block_table_BP.shape[0]
    H = hot_table_BH.shape[1]
    S, M = host_row_SM.shape
    N = T * K
    nhr = jnp.asarray(num_host_blocks, jnp.int32) * tpp

    # ---------------------------------------------------------------- candidates
    pos = topk_TK.reshape(N).astype(jnp.int32)
    b_N = jnp.repeat(req_idx_T.astype(jnp.int32), K)
    off, res_block, host_block, resident, need = _lookup(pos, b_N, block_table_BP, host_table_BP, state_row_B, S,
                                                         nhr, tpp)
    srow_B = state_row_B.astype(jnp.int32)
    has_state_B = (srow_B >= 0) & (srow_B < S)
    hrow = host_block * tpp + off

    # ---------------------------------------------------------------- state of the batch rows
    srow = jnp.where(has_state_B, srow_B, 0)
    st = host_row_SM[srow].astype(jnp.int32)  # [B, M]
    rk = rank_SM[srow].astype(jnp.int32)
    j_M = jnp.arange(M, dtype=jnp.int32)
    hp_idx = _divmod(j_M, tpp)[0]
    hot_page = jnp.where(hp_idx[None, :] < H, hot_table_BH[:, jnp.minimum(hp_idx, H - 1)], 0)  # [B, M]
    usable = (hot_page > 0) & has_state_B[:, None]
    st = jnp.where(j_M[None, :] >= reset_from_B[:, None], -1, st)
    ok = usable & (st >= tpp) & (st < nhr)
    # Two slots claiming one host row: both dropped.
    key = jnp.where(ok, st, _BIG)
    srt, srt_j = lax.sort((key, jnp.broadcast_to(j_M, (B, M))), dimension=1, num_keys=1)
    dup_sorted = (srt < _BIG) & (
        (jnp.pad(srt[:, 1:], ((0, 0), (0, 1)), constant_values=-2) == srt)
        | (jnp.pad(srt[:, :-1], ((0, 0), (1, 0)), constant_values=-2) == srt))
    dup = jnp.zeros((B, M), bool).at[jnp.arange(B)[:, None], srt_j].set(dup_sorted)
    ok = ok & ~dup
    st = jnp.where(ok, st, -1)

    # ---------------------------------------------------------------- hits: the sorted state
    # Each candidate looks its host row up in its batch row's state, sorted above (`srt`): a hit
    # when an entry that passed the checks holds it (a duplicated row was dropped, entries and all).
    hit_N, j_hit_N = _find_in_rows(srt, srt_j, dup_sorted, b_N, hrow)
    hit_N = need & hit_N
    hit_BM = jnp.zeros((B, M), bool).at[jnp.where(hit_N, b_N, B), j_hit_N].set(True, mode="drop")

    # ---------------------------------------------------------------- distinct candidates
    # Stable on (batch row, host row): each group's first element is its first occurrence.
    c_b, c_h, s_idx = lax.sort((jnp.where(need, b_N, _BIG), jnp.where(need, hrow, _BIG),
                                jnp.arange(N, dtype=jnp.int32)), num_keys=2, is_stable=True)
    valid = c_b < _BIG
    start = valid & ((c_b != jnp.roll(c_b, 1)) | (c_h != jnp.roll(c_h, 1)) | (jnp.arange(N) == 0))
    first_N = jnp.zeros(N, jnp.int32).at[s_idx].set(s_idx[_seg_first(start)])  # each candidate's group's first
    g_hit = hit_N[s_idx]  # (the same for every element of a group)
    miss_start = valid & start & ~g_hit  # first (lowest index) candidate of a missing row

    # Miss rank in first-occurrence order, per batch row (its tokens are contiguous).
    flag_N = jnp.zeros(N, jnp.int32).at[jnp.where(miss_start, s_idx, N)].set(1, mode="drop")
    excl = jnp.cumsum(flag_N) - flag_N
    first_tok = jnp.full(B, T, jnp.int32).at[req_idx_T].min(jnp.arange(T, dtype=jnp.int32))
    base_B = excl[jnp.minimum(first_tok, T - 1) * K]
    n_miss_B = jnp.zeros(B, jnp.int32).at[b_N].add(flag_N)
    rank_N = excl - base_B[b_N]

    # Evictable slots in order: empty first, then LRU rank, then index; hits, then unusable last.
    cls = jnp.where(~usable, 2, jnp.where(hit_BM, 1, 0))
    cls_empty = 2 * cls + jnp.where(st < 0, 0, 1)  # class, then empty slots first
    order = _order_by_class_and_rank(cls_empty, rk, num_classes=6)
    n_evict_B = jnp.sum(cls == 0, axis=1)
    taken_B = jnp.minimum(n_miss_B, n_evict_B)

    # Slots of the missing rows.
    slot_j_N = jnp.where((flag_N > 0) & (rank_N < n_evict_B[b_N]), order[b_N, jnp.clip(rank_N, 0, M - 1)], -1)
    # Each selection's slot index j: a hit's state entry, a miss's first candidate's slot.
    j_N = jnp.where(need, jnp.where(hit_N, j_hit_N, slot_j_N[first_N]), -1)
    jj = jnp.clip(j_N, 0, M - 1)
    jj_page, jj_off = _divmod(jj, tpp)
    hot_slot_N = hot_table_BH[b_N, jj_page] * tpp + jj_off
    slots = jnp.where(resident, res_block * tpp + off, jnp.where(need & (j_N >= 0), hot_slot_N, -1))

    # Compact miss list (first-occurrence order over the whole batch).
    got = (flag_N > 0) & (slot_j_N >= 0)
    dest = jnp.cumsum(got.astype(jnp.int32)) - 1
    sj = jnp.clip(slot_j_N, 0, M - 1)
    sj_page, sj_off = _divmod(sj, tpp)
    miss_slot = hot_table_BH[b_N, sj_page] * tpp + sj_off
    miss_host_row = jnp.full(N, -1, jnp.int32).at[jnp.where(got, dest, N)].set(hrow, mode="drop")
    miss_slot_X = jnp.full(N, -1, jnp.int32).at[jnp.where(got, dest, N)].set(miss_slot, mode="drop")

    # ---------------------------------------------------------------- new state
    new_st = st.at[jnp.where(got, b_N, B), sj].set(hrow, mode="drop")
    pos_M = jnp.broadcast_to(j_M, (B, M))
    o_cls = jnp.take_along_axis(cls, order, axis=1)
    tk = taken_B[:, None]
    ne = n_evict_B[:, None]
    new_pos = jnp.where(o_cls == 0, jnp.where(pos_M >= tk, pos_M - tk, ne - tk + pos_M), pos_M)
    new_rk = jnp.zeros((B, M), jnp.int32).at[jnp.arange(B)[:, None], order].set(new_pos)
    wb = jnp.where(has_state_B, srow, S)  # rows without state write nothing
    host_row_SM = host_row_SM.at[wb].set(new_st.astype(host_row_SM.dtype), mode="drop")
    rank_SM = rank_SM.at[wb].set(new_rk.astype(rank_SM.dtype), mode="drop")

    hits = jnp.sum(start & g_hit)
    misses = jnp.sum(got)
    dropped = jnp.sum(flag_N) - misses
    stats = jnp.stack([hits, misses, dropped]).astype(jnp.int32)
    return slots.reshape(T, K).astype(jnp.int32), miss_host_row, miss_slot_X, stats, host_row_SM, rank_SM


@functools.partial(jax.jit, static_argnames=("tokens_per_page",))
def dropped_selections(
    topk_TK: jax.Array,
    req_idx_T: jax.Array,
    block_table_BP: jax.Array,
    host_table_BP: jax.Array,
    state_row_B: jax.Array,
    num_state_rows: int | jax.Array,
    num_host_blocks: jax.Array | int,
    slots_TK: jax.Array,
    *,
    tokens_per_page: int,
) -> jax.Array:
    """bool `[T, K]`: the selections that needed the hot buffer and got no slot (`dropped`).

    A selection needs the hot buffer when its page is not resident, has a host copy and its batch
    row has hot state (the resolver's contract above); it is dropped when the resolver returned
    slot −1 for it. Computed from the resolver's inputs and its `slots_TK`, so it holds for every
    implementation. Because misses take slots in first-occurrence order (query row, then top-k
    order), the query rows of a batch row before its first row with a dropped selection are
    fully resolved."""
    tpp = tokens_per_page
    pos = topk_TK.astype(jnp.int32)
    b = jnp.broadcast_to(req_idx_T.astype(jnp.int32)[:, None], pos.shape)
    nhr = jnp.asarray(num_host_blocks, jnp.int32) * tpp
    need = _lookup(pos, b, block_table_BP, host_table_BP, state_row_B, num_state_rows, nhr, tpp)[4]
    return need & (slots_TK < 0)
