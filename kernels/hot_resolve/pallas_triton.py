"""HiSparse hot-buffer resolver as Pallas kernels lowered through Triton.

Same contract and outputs as `reference.hot_resolve_reference` (read that docstring: it is the
specification), bit for bit: every output is an integer and every step below is exact. Nothing is
sorted: Triton has no sort we can rely on, so each ordering of the contract is computed as a rank,
"how many entries come before me", by comparing blocks of entries against blocks of entries.

Four Pallas kernels, each on a grid of independent programs, with cheap JAX glue between them
(elementwise maps, one cumsum over the candidates, the final scatter of the state rows):

  glue      candidates: host row `cand_N` of every position that needs the hot buffer (−1: none)
            and `base_N`, the slot of a resident position (−1: none), the reference's own maps.
  validate  grid (B, M / block_m). A block of slots of batch row b: its state row entries after
            the reset, the usable-slot and host-row range checks, then duplicate detection against
            every other block of the row (a `[block_m, block_m]` equality tile per block).
            → `st [B, M]`: the validated host row of every slot (−1 empty).
  lookup    grid (T, K / block_c). A block of one token's candidates: hit lookup against every
            block of the row's validated state (`[block_c, block_m]` tiles; the matching slot
            index, unique since the state has no duplicates), first occurrence among the row's
            earlier candidates (`[block_c, block_c]` tiles, blocks up to this one), and the flags
            of first-occurring misses. Hit slots are flagged in `hit [B, M]` (a scatter of 1s).
  glue      miss rank of every first-occurring miss in (query row, top-k) order: an exclusive
            cumsum of the flags minus its value at the row's first candidate (rows contiguous),
            and the misses per row.
  rank      grid (B, M / block_m). Class of each slot (0 evictable: usable, not hit; 1 hit;
            2 unusable), the class counts, and for a block of slots the number of slots of the
            same class ordered before each (key: empty first, then old rank, then index;
            `[block_m, block_m]` tiles): its position p in the contract's LRU order. New rank:
            evictable p ≥ taken → p − taken, p < taken → n_evict − taken + p (the slots the
            misses take, in miss order), hits n_evict + p, unusable n_evict + n_hit + p.
            Evictable slot j is written to `order[b, p]`.
  glue      which first occurrences get a slot (miss rank < n_evict) and their place in the
            compact miss list (cumsum over the whole batch, first-occurrence order).
  assign    grid (T, K / block_c). Slot of every candidate: resident → base; hit → its slot;
            miss → `order[b, miss rank of its first occurrence]` or −1 (dropped); the hot slot
            is `hot_table[b, j // tpp]·tpp + j % tpp`. First occurrences that got a slot write the
            copy (host row, hot slot) at their place in the miss list and their host row into
            the new state.

Per batch row with C = R·K candidates (R query rows) and state width M the work is O(M²)
compares (validate) + O(C·M) (hit lookup) + O(C²/2) (first occurrence) + O(M²) (ranks) +
O(C) (assign); blocks with nothing to compare (no valid entry, no candidate that needs the hot
buffer, no miss) and rows without hot state skip their loops. At B = 65, M = 4096, K = 2048
(decode) that is about 16.8M + 8.4M + 2.1M + 16.8M ≈ 44M element compares per row, ~3G for the
batch, spread over grids of 65 × 64 (slot blocks) and 65 × 32 (candidate blocks) programs.
Temporaries: int32 `[B, M + 1]` (validated state, hit flags, order; column M is the
sink of masked scatters, so interpret mode never writes one address twice with different
values), `[B, M]` (new ranks) and `[T·K]` (candidate columns). The lowering is checked for CUDA
(tests/kernels/test_pallas_lowering.py); the kernels have not yet been timed on a GPU.

What the kernels do not do: read or copy host rows (`kernels.host_rows` runs the copies this
op plans), sort anything, or handle rows whose tokens are not contiguous (the `ForwardBatch`
contract, which the reference assumes too). `req_idx` must lie in [0, B) (clamped here). Two
batch rows naming one state row both resolve against its old state and both write it back
through the same XLA scatter as the reference (which of the two rows lands is XLA's choice).

Supported (else NotImplementedError, which the dispatch turns into the reference): block sizes
that are powers of two (≥ 16 on GPU; interpret mode takes any power of two), non-empty shapes
(T·K, B, P, H, S, M ≥ 1), M ≤ 65536 (the quadratic per-row passes; past it the reference's
sort is cheaper), T·K, B·(M + 1) and S·M below 2³¹.

Lowering note (JAX 0.11): a `jnp.where` whose value operands are all Python constants lowers in
Pallas Triton with the predicate's i1 type; the kernels keep one operand an int32 array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.pallas_rows import is_power_of_two, next_power_of_two

_BIG = jnp.iinfo(jnp.int32).max
MAX_STATE_WIDTH = 1 << 16


def unsupported_reason(T: int, K: int, B: int, P: int, H: int, S: int, M: int, *, block_m: int = 64,
                       block_c: int = 64, interpret: bool = False) -> str | None:
    """Why the kernels cannot run `T` tokens × `K` positions over `B` batch rows of `P` pages and
    `H` hot pages, with `S` state rows of width `M`, or None when they can."""
    if min(T * K, B, P, H, S, M) < 1:
        return f"empty shape (T·K={T * K}, B={B}, P={P}, H={H}, S={S}, M={M})"
    if M > MAX_STATE_WIDTH:
        return f"state width {M} > {MAX_STATE_WIDTH} (quadratic per-row passes)"
    if max(T * K + 1, B * (M + 1), S * M) >= 2**31:
        return "index space beyond int32"
    least = 1 if interpret else 16
    if not (is_power_of_two(block_m) and is_power_of_two(block_c) and min(block_m, block_c) >= least):
        return f"block_m={block_m}, block_c={block_c} must be powers of two >= {least}"
    return None


# --------------------------------------------------------------------------- in-kernel helpers
def _iota(n):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _hot_page(hot_ref, b, j, *, H: int, tpp: int):
    """Hot page of slots j ≥ 0 of batch row b (0: unusable, also beyond the table)."""
    page = lax.div(j, jnp.int32(tpp))
    inside = (j >= 0) & (page < H)
    return plgpu.load(hot_ref.at[b, jnp.where(inside, page, 0)], mask=inside, other=0)


def _hot_slot(hot_ref, b, j, *, H: int, tpp: int):
    """Arena slot of hot slots j of batch row b (−1 where j < 0)."""
    slot = _hot_page(hot_ref, b, j, H=H, tpp=tpp) * tpp + lax.rem(jnp.maximum(j, 0), jnp.int32(tpp))
    return jnp.where(j >= 0, slot, -1)


def _checked_entries(host_row_ref, hot_ref, b, srow, has_state, reset_from, nhr, j0, *, M, H, tpp, bm):
    """Host rows held by slots j0 + [0, bm) of batch row b after the reset, the usable-slot and
    the host-row range checks (−1: empty); duplicates are not yet dropped."""
    j = j0 + _iota(bm)
    raw = plgpu.load(host_row_ref.at[srow, pl.ds(j0, bm)], mask=j < M, other=-1)
    ok = (has_state & (j < M) & (j < reset_from) & (_hot_page(hot_ref, b, j, H=H, tpp=tpp) > 0)
          & (raw >= tpp) & (raw < nhr))
    return jnp.where(ok, raw, -1)


def _state_row(srow_ref, b, S: int):
    srow = srow_ref[b]
    has_state = (srow >= 0) & (srow < S)
    return jnp.where(has_state, srow, 0), has_state


# --------------------------------------------------------------------------- kernels
def _validate_kernel(srow_ref, reset_ref, nhr_ref, hot_ref, host_row_ref, st_ref, *, M, H, S, tpp, bm):
    """st[b, block] = the block's checked entries, dropping host rows another slot also holds."""
    b, blk = pl.program_id(0), pl.program_id(1)
    srow, has_state = _state_row(srow_ref, b, S)
    entries = functools.partial(_checked_entries, host_row_ref, hot_ref, b, srow, has_state, reset_ref[b],
                                nhr_ref[0], M=M, H=H, tpp=tpp, bm=bm)
    j0 = blk * bm
    st = entries(j0)
    ids = j0 + _iota(bm)

    def body(jb, dup):
        other = entries(jb * bm)
        same = (st[:, None] == other[None, :]) & (other[None, :] >= 0) & (ids[:, None] != jb * bm + _iota(bm)[None, :])
        return jnp.maximum(dup, jnp.max(same.astype(jnp.int32), axis=1))

    n_blocks = jnp.where(jnp.max(st) >= 0, jnp.int32(pl.cdiv(M, bm)), 0)
    dup = lax.fori_loop(jnp.int32(0), n_blocks, body, jnp.zeros((bm,), jnp.int32))
    plgpu.store(st_ref.at[b, pl.ds(j0, bm)], jnp.where(dup > 0, -1, st), mask=ids < M)


def _lookup_kernel(b_ref, t0_ref, cand_ref, st_ref, _hit_in, hitj_ref, first_ref, fm_ref, hit_ref, *, K, M, N, bc, bm):
    """A block of token t's candidates: hit slot, first occurrence in the row, first-miss flag."""
    t, kb = pl.program_id(0), pl.program_id(1)
    b = b_ref[t]
    c0 = t * K + kb * bc
    c = c0 + _iota(bc)
    in_block = kb * bc + _iota(bc) < K
    h = plgpu.load(cand_ref.at[pl.ds(c0, bc)], mask=in_block, other=-1)
    valid = h >= 0

    def hit_body(jb, hitj):
        ids = jb * bm + _iota(bm)
        st = plgpu.load(st_ref.at[b, pl.ds(jb * bm, bm)], mask=ids < M, other=-1)
        eq = (h[:, None] == st[None, :]) & valid[:, None]
        return jnp.maximum(hitj, jnp.max(jnp.where(eq, ids[None, :], -1), axis=1))

    n_slot_blocks = jnp.where(jnp.max(h) >= 0, jnp.int32(pl.cdiv(M, bm)), 0)
    hitj = lax.fori_loop(jnp.int32(0), n_slot_blocks, hit_body, jnp.full((bc,), -1, jnp.int32))
    miss = valid & (hitj < 0)

    r0 = t0_ref[b] * K  # the row's first candidate (its tokens are contiguous)

    def first_body(i, first):
        cj = r0 + i * bc + _iota(bc)
        hj = plgpu.load(cand_ref.at[pl.ds(r0 + i * bc, bc)], mask=cj < N, other=-1)
        eq = (h[:, None] == hj[None, :]) & (hj[None, :] >= 0) & (cj[None, :] <= c[:, None])
        return jnp.minimum(first, jnp.min(jnp.where(eq, cj[None, :], _BIG), axis=1))

    n_cand_blocks = jnp.where(jnp.max(miss.astype(jnp.int32)) > 0, lax.div(c0 + (bc - 1) - r0, jnp.int32(bc)) + 1, 0)
    first = lax.fori_loop(jnp.int32(0), n_cand_blocks, first_body, jnp.full((bc,), _BIG, jnp.int32))
    fm = miss & (first == c)

    plgpu.store(hitj_ref.at[pl.ds(c0, bc)], hitj, mask=in_block)
    plgpu.store(first_ref.at[pl.ds(c0, bc)], first, mask=in_block)
    plgpu.store(fm_ref.at[pl.ds(c0, bc)], fm.astype(jnp.int32), mask=in_block)
    hit = hitj >= 0  # several candidates may flag one slot: they all write 1
    plgpu.store(hit_ref.at[b, jnp.where(hit, hitj, M)], jnp.ones((bc,), jnp.int32), mask=hit)


def _rank_kernel(srow_ref, n_miss_ref, hot_ref, st_ref, hit_ref, rank_ref, new_rank_ref, order_ref, n_evict_ref,
                 n_hit_ref, *, M, H, S, tpp, bm):
    """New LRU ranks of a block of slots of batch row b; evictable slots into `order`."""
    b, blk = pl.program_id(0), pl.program_id(1)
    srow, has_state = _state_row(srow_ref, b, S)

    def classes(j0):
        """(class, non-empty, old rank) of slots j0 + [0, bm); class 3 beyond M."""
        j = j0 + _iota(bm)
        inside = j < M
        usable = has_state & (_hot_page(hot_ref, b, j, H=H, tpp=tpp) > 0)
        hit = plgpu.load(hit_ref.at[b, pl.ds(j0, bm)], mask=inside, other=0) > 0
        st = plgpu.load(st_ref.at[b, pl.ds(j0, bm)], mask=inside, other=-1)
        rk = plgpu.load(rank_ref.at[srow, pl.ds(j0, bm)], mask=inside, other=0)
        cls = jnp.where(~inside, 3, jnp.where(~usable, 2, hit.astype(jnp.int32)))
        return cls, (st >= 0).astype(jnp.int32), rk

    n_blocks = jnp.where(has_state, jnp.int32(pl.cdiv(M, bm)), 0)

    def count_body(jb, counts):
        cls, _, _ = classes(jb * bm)
        return counts[0] + jnp.sum((cls == 0).astype(jnp.int32)), counts[1] + jnp.sum((cls == 1).astype(jnp.int32))

    n_evict, n_hit = lax.fori_loop(jnp.int32(0), n_blocks, count_body, (jnp.int32(0), jnp.int32(0)))

    j0 = blk * bm
    ids = j0 + _iota(bm)
    cls, ne, rk = classes(j0)

    def pos_body(jb, pos):
        c2, ne2, rk2 = classes(jb * bm)
        ids2 = jb * bm + _iota(bm)
        before = (ne2[None, :] < ne[:, None]) | ((ne2[None, :] == ne[:, None]) & (
            (rk2[None, :] < rk[:, None]) | ((rk2[None, :] == rk[:, None]) & (ids2[None, :] < ids[:, None]))))
        return pos + jnp.sum(((c2[None, :] == cls[:, None]) & before).astype(jnp.int32), axis=1)

    p = lax.fori_loop(jnp.int32(0), n_blocks, pos_body, jnp.zeros((bm,), jnp.int32))
    taken = jnp.minimum(n_miss_ref[b], n_evict)
    new_rank = jnp.where(cls == 0, jnp.where(p >= taken, p - taken, n_evict - taken + p),
                         jnp.where(cls == 1, n_evict + p, n_evict + n_hit + p))
    plgpu.store(new_rank_ref.at[b, pl.ds(j0, bm)], new_rank, mask=ids < M)
    evictable = cls == 0
    plgpu.store(order_ref.at[b, jnp.where(evictable, p, M)], ids, mask=evictable)
    n_evict_ref[b] = n_evict  # every program of the row writes the same counts
    n_hit_ref[b] = n_hit


def _assign_kernel(b_ref, n_evict_ref, cand_ref, base_ref, hitj_ref, first_ref, mrank_ref, dest_ref, order_ref,
                   hot_ref, _st_in, _rows_in, _slots_in, slots_ref, st_ref, miss_row_ref, miss_slot_ref, *, K, M, N,
                   H, tpp, bc):
    """Slots of a block of token t's candidates; the copies and new state entries of its misses."""
    t, kb = pl.program_id(0), pl.program_id(1)
    b = b_ref[t]
    c0 = t * K + kb * bc
    c = c0 + _iota(bc)
    in_block = kb * bc + _iota(bc) < K

    def column(ref, other):
        return plgpu.load(ref.at[pl.ds(c0, bc)], mask=in_block, other=other)

    h, base, hitj, first = column(cand_ref, -1), column(base_ref, -1), column(hitj_ref, -1), column(first_ref, 0)
    miss = (h >= 0) & (hitj < 0)
    r = plgpu.load(mrank_ref.at[jnp.where(miss, first, 0)], mask=miss, other=0)  # rank of its first occurrence
    got = miss & (r < n_evict_ref[b])
    j = jnp.where(hitj >= 0, hitj, jnp.where(got, plgpu.load(order_ref.at[b, jnp.where(got, r, 0)], mask=got,
                                                                 other=-1), -1))
    hot = _hot_slot(hot_ref, b, j, H=H, tpp=tpp)
    plgpu.store(slots_ref.at[pl.ds(c0, bc)], jnp.where(h < 0, base, hot), mask=in_block)

    new = got & (first == c)  # the first occurrence writes the copy and the state entry
    dest = jnp.where(new, plgpu.load(dest_ref.at[pl.ds(c0, bc)], mask=new, other=N), N)
    plgpu.store(miss_row_ref.at[dest], h, mask=new)
    plgpu.store(miss_slot_ref.at[dest], hot, mask=new)
    plgpu.store(st_ref.at[b, jnp.where(new, j, M)], h, mask=new)


# --------------------------------------------------------------------------- entry point
@functools.partial(jax.jit, static_argnames=("tokens_per_page", "block_m", "block_c", "num_warps", "interpret"))
def hot_resolve_pallas_triton(
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
    block_m: int = 64,
    block_c: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
):
    """Resolve selected positions to arena slots (Pallas/Triton); see `reference.hot_resolve_reference`.

    Args: as the reference, plus
      block_m: slots per block (validate and rank tiles `[block_m, block_m]`), block_c: candidates
        per block (lookup tiles `[block_c, block_m]`, `[block_c, block_c]`); both capped at the
        next power of two of M and K. num_warps: Triton launch parameter.
      interpret: run the kernels in Pallas interpret mode (any backend; for tests).
    Returns:
      As the reference: slots_TK, miss_host_row_X, miss_slot_X, stats `[hits, misses, dropped]`,
      new host_row_SM, rank_SM — bit-identical to it.
    Raises:
      NotImplementedError: a configuration outside the module docstring's supported set.
    """
    tpp = tokens_per_page
    T, K = topk_TK.shape
    B, P = block_table_BP.shape
    H = hot_table_BH.shape[1]
    S, M = host_row_SM.shape
    N = T * K
    least = 1 if interpret else 16
    bm = max(least, min(block_m, next_power_of_two(M)))
    bc = max(least, min(block_c, next_power_of_two(K)))
    reason = unsupported_reason(T, K, B, P, H, S, M, block_m=bm, block_c=bc, interpret=interpret)
    if reason is not None:
        raise NotImplementedError(f"hot_resolve pallas_triton: {reason}")
    i32 = jnp.int32
    nhr = jnp.asarray(num_host_blocks, i32) * tpp
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    call = functools.partial(pl.pallas_call, compiler_params=params, interpret=interpret)
    hot_table = hot_table_BH.astype(i32)

    # ---------------------------------------------------------------- candidates (glue)
    pos = topk_TK.reshape(N).astype(i32)
    b_T = jnp.clip(req_idx_T.astype(i32), 0, B - 1)
    b_N = jnp.repeat(b_T, K)
    page = jnp.clip(pos, 0) // tpp
    in_range = (pos >= 0) & (page < P)
    page = jnp.minimum(page, P - 1)
    off = jnp.clip(pos, 0) % tpp
    res_block = block_table_BP[b_N, page].astype(i32)
    host_block = host_table_BP[b_N, page].astype(i32)
    resident = in_range & (res_block > 0)
    srow_B = state_row_B.astype(i32)
    has_state_B = (srow_B >= 0) & (srow_B < S)
    need = in_range & ~resident & (host_block > 0) & (host_block * tpp < nhr) & has_state_B[b_N]
    cand_N = jnp.where(need, host_block * tpp + off, -1)
    base_N = jnp.where(resident, res_block * tpp + off, -1)
    first_tok_B = jnp.full(B, T, i32).at[b_T].min(jnp.arange(T, dtype=i32))
    t0_B = jnp.minimum(first_tok_B, T - 1)

    slot_grid = (B, pl.cdiv(M, bm))
    cand_grid = (T, pl.cdiv(K, bc))
    host_row = host_row_SM.astype(i32)
    any_spec = pl.no_block_spec

    # ---------------------------------------------------------------- validate
    st_BM = call(
        functools.partial(_validate_kernel, M=M, H=H, S=S, tpp=tpp, bm=bm),
        out_shape=jax.ShapeDtypeStruct((B, M + 1), i32),  # column M: sink of masked scatters
        grid=slot_grid, in_specs=[any_spec] * 5, out_specs=any_spec, name="hot_resolve_validate",
    )(srow_B, reset_from_B.astype(i32), nhr.reshape(1), hot_table, host_row)

    # ---------------------------------------------------------------- lookup
    col = jax.ShapeDtypeStruct((N,), i32)
    hitj_N, first_N, fm_N, hit_BM = call(
        functools.partial(_lookup_kernel, K=K, M=M, N=N, bc=bc, bm=bm),
        out_shape=(col, col, col, jax.ShapeDtypeStruct((B, M + 1), i32)),
        grid=cand_grid, in_specs=[any_spec] * 5, out_specs=[any_spec] * 4, input_output_aliases={4: 3},
        name="hot_resolve_lookup",
    )(b_T, t0_B, cand_N, st_BM, jnp.zeros((B, M + 1), i32))

    # ---------------------------------------------------------------- miss ranks (glue)
    excl = jnp.cumsum(fm_N) - fm_N
    mrank_N = excl - excl[t0_B * K][b_N]
    n_miss_B = jnp.zeros(B, i32).at[b_N].add(fm_N)

    # ---------------------------------------------------------------- rank
    row = jax.ShapeDtypeStruct((B,), i32)
    new_rank_BM, order_BM, n_evict_B, n_hit_B = call(
        functools.partial(_rank_kernel, M=M, H=H, S=S, tpp=tpp, bm=bm),
        out_shape=(jax.ShapeDtypeStruct((B, M), i32), jax.ShapeDtypeStruct((B, M + 1), i32), row, row),
        grid=slot_grid, in_specs=[any_spec] * 6, out_specs=[any_spec] * 4, name="hot_resolve_rank",
    )(srow_B, n_miss_B, hot_table, st_BM, hit_BM, rank_SM.astype(i32))

    # ---------------------------------------------------------------- places in the miss list (glue)
    got_N = (fm_N > 0) & (mrank_N < n_evict_B[b_N])
    dest_N = jnp.cumsum(got_N.astype(i32)) - 1

    # ---------------------------------------------------------------- assign
    slots_N, new_st_BM, miss_row, miss_slot = call(
        functools.partial(_assign_kernel, K=K, M=M, N=N, H=H, tpp=tpp, bc=bc),
        out_shape=(col, jax.ShapeDtypeStruct((B, M + 1), i32), jax.ShapeDtypeStruct((N + 1,), i32),
                   jax.ShapeDtypeStruct((N + 1,), i32)),  # element N: sink of masked scatters
        grid=cand_grid, in_specs=[any_spec] * 13, out_specs=[any_spec] * 4,
        input_output_aliases={10: 1, 11: 2, 12: 3}, name="hot_resolve_assign",
    )(b_T, n_evict_B, cand_N, base_N, hitj_N, first_N, mrank_N, dest_N, order_BM, hot_table, st_BM,
      jnp.full(N + 1, -1, i32), jnp.full(N + 1, -1, i32))

    # ---------------------------------------------------------------- stats, state rows (glue)
    misses = jnp.sum(got_N.astype(i32))
    stats = jnp.stack([jnp.sum(n_hit_B), misses, jnp.sum(fm_N) - misses]).astype(i32)
    wb = jnp.where(has_state_B, srow_B, S)  # rows without state write nothing
    host_row_SM = host_row_SM.at[wb].set(new_st_BM[:, :M].astype(host_row_SM.dtype), mode="drop")
    rank_SM = rank_SM.at[wb].set(new_rank_BM.astype(rank_SM.dtype), mode="drop")
    return slots_N.reshape(T, K), miss_row[:N], miss_slot[:N], stats, host_row_SM, rank_SM
