"""Block-scaled FP8 weight matmuls (W8A16) as Pallas kernels lowered through Triton.

Same contracts as `reference.fp8_matmul_reference` (2-D weights) and
`reference.fp8_grouped_matmul_reference` (read those docstrings and the module docstring of
`reference` for the format): `x [M, K]` (bfloat16 or float32) times the block-scaled weight
`w_fp8 float8_e4m3fn [K, N]` · `scale_inv float32 [K/bk, ceil(N/bn)]`, fp32 accumulation.

Kernel (one program per `[block_m, block_n]` output tile; the dense form also splits K):
  * the program walks K in steps of one scale block (`bk` rows of the weight): it loads the x
    tile `[block_m, bk]` and the fp8 weight tile `[bk, block_n]` (masked at the M and N edges:
    rows / columns past the end are never read and never written), converts the fp8 tile in
    registers to x's dtype (e4m3 → bf16 and e4m3 → fp32 are exact), and computes the partial
    product with fp32 accumulation: bf16 × bf16 on the tensor cores for bf16 x, IEEE fp32 dots
    (`precision=HIGHEST`) for fp32 x;
  * the partial product is multiplied by its block's fp32 scale before it is added to the fp32
    accumulator (DeepGEMM's scale promotion): one scalar per (k-block, n-tile) when `block_n`
    divides `bn` (GLM-5.3: bn = 128), otherwise a per-column vector `scale_inv[kb, col // bn]`;
  * the tile is cast to the output dtype and stored (masked).
The weight — the big operand — is read exactly once per (row tile, column tile) from its own
buffer: never copied, padded or dequantised in memory by the wrapper.

Dense form (`fp8_matmul_pallas_triton`): grid (M tiles, N tiles, K splits), M tiles fastest so
that consecutive programs share a weight tile (served from L2). At decode sizes (few output
tiles) K is split into `split_k` contiguous ranges of k-blocks written as fp32 partials
`[split_k, M, N]` and summed by XLA (`auto_split_k`: enough programs for the 132 SMs of an H200
while the partials' traffic stays within the weight's bytes). Tile and split defaults are first
guesses, not yet measured on a GPU (`scripts/bench_kernels.py --sections fp8` sweeps them).

Grouped form (`fp8_grouped_matmul_pallas_triton`, MoE experts, `lax.ragged_dot` semantics): a
static upper bound `cdiv(M, block_m) + E` of row tiles; each group's rows are cut into tiles of
at most `block_m` rows (an empty group gets none), then the rows past Σ group_sizes get "zero"
tiles. The per-tile metadata (`tile_metadata`: expert, first row, row count; computed in JAX from
the traced group sizes) are ordinary int32 inputs: the kernel loads its tile's expert id and
addresses that expert's weight and scales with dynamic indexing (GPU index maps cannot read
data). Unused tiles (count 0) do nothing; zero tiles store zeros; an empty group costs nothing.
Grid (row tiles, N tiles), row tiles fastest: the row tiles of one expert run back to back on the
same weight tile.

Supported (else NotImplementedError; `unsupported_reason` says why): x float32 or bfloat16, w
float8_e4m3fn, K a multiple of bk (every GLM-5.3 K is a multiple of 128; the reference handles
a partial K block), scales of the right shape; outside interpret mode bk, block_m and block_n
powers of two ≥ 16 (Triton's dot and its power-of-two tensor sizes); `split_k` dividing K / bk.
`block_n` may be smaller than, equal to or larger than bn.

Accuracy against the reference: fp32 x agrees to fp32 rounding (~1e-6 relative); bf16 x: the
reference rounds the dequantised weight (fp8 · scale) to bf16 before its dot, the kernel dots the
exact fp8 values and scales the fp32 partial, so the two differ by the reference's bf16 weight
rounding (unit roundoff 2^-8 relative per product, averaging out over K) — the kernel is the more exact one.

JAX 0.11 marks the Pallas Triton backend deprecated in favour of Mosaic GPU (a warning at
lowering); the kernels keep to the plain load / dot / store subset.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.fp8_matmul.reference import FP8_DTYPE, scale_shape

X_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
H200_PROGRAMS = 264  # two programs per SM of a 132-SM H200


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_block_m(rows_per_group: int) -> int:
    """Rows per program: the next power of two ≥ the (average) rows, within [16, 64]."""
    return int(min(64, max(16, _next_pow2(max(1, rows_per_group)))))


def default_block_n(bn: int, m: int) -> int:
    """Columns per program: 64 at decode sizes (m ≤ 128: more programs), 128 above, lowered to the
    largest power of two ≥ 16 dividing bn when there is one (one scale per tile)."""
    want = 64 if m <= 128 else 128
    for c in (want, 64, 32, 16):
        if c <= want and bn % c == 0:
            return c
    return want  # bn has no power-of-two divisor ≥ 16: per-column scales


def auto_split_k(tiles: int, k_blocks: int, m: int, K: int, *, target_programs: int = H200_PROGRAMS) -> int:
    """K splits for the dense kernel: the largest divisor of `k_blocks` that is at most
    `ceil(target_programs / tiles)` and keeps the fp32 partials (split · m · N · 4 B, written then
    read back) within the fp8 weight's bytes (K · N), i.e. split ≤ K / (8 · m)."""
    if tiles >= target_programs or k_blocks <= 1:
        return 1
    want = _cdiv(target_programs, tiles)
    cap = max(1, K // (8 * max(1, m)))
    best = 1
    for d in range(1, k_blocks + 1):
        if k_blocks % d == 0 and d <= min(want, cap):
            best = d
    return best


def unsupported_reason(x, w_fp8, scale_inv, *, block: tuple[int, int], block_m: int | None = None,
                       block_n: int | None = None, split_k: int | None = None, grouped: bool = False,
                       interpret: bool = False) -> str | None:
    """Why the Pallas kernel cannot run this configuration, or None when it can.

    x, w_fp8, scale_inv: arrays or anything with `.shape` and `.dtype` (x `[M, K]`, w `[K, N]`,
    or `[E, K, N]` with `grouped`). Interpret mode drops the GPU-only tile constraints.
    """
    bk, bn = block
    if jnp.dtype(x.dtype) not in X_DTYPES:
        return f"x dtype {x.dtype} is not bfloat16 or float32"
    if jnp.dtype(w_fp8.dtype) != jnp.dtype(FP8_DTYPE):
        return f"weight dtype {w_fp8.dtype} is not float8_e4m3fn"
    if w_fp8.ndim != (3 if grouped else 2):
        return f"weight rank {w_fp8.ndim}: the {'grouped' if grouped else 'dense'} kernel takes " \
               f"{'[E, K, N]' if grouped else '[K, N]'}"
    if x.ndim != 2:
        return f"x rank {x.ndim}: the kernel takes [M, K]"
    K, N = w_fp8.shape[-2:]
    if x.shape[1] != K:
        return f"x width {x.shape[1]} != weight K {K}"
    if tuple(scale_inv.shape) != scale_shape(tuple(w_fp8.shape), (bk, bn)):
        return f"scale_inv {tuple(scale_inv.shape)} != {scale_shape(tuple(w_fp8.shape), (bk, bn))}"
    if K % bk:
        return f"K={K} is not a multiple of bk={bk} (a partial K block: use the reference)"
    M = x.shape[0]
    E = w_fp8.shape[0] if grouped else 1
    bm = block_m or default_block_m(_cdiv(M, E))
    bnt = block_n or default_block_n(bn, M)
    if not interpret:
        for name, v in (("bk", bk), ("block_m", bm), ("block_n", bnt)):
            if not (_pow2(v) and v >= 16):
                return f"{name}={v} must be a power of two >= 16 (Triton dot and tensor sizes)"
    if split_k is not None and (split_k < 1 or (K // bk) % split_k):
        return f"split_k={split_k} must divide K/bk={K // bk}"
    if not interpret and _element_offsets_wrap(w_fp8.shape, w_fp8.dtype):
        return (f"weight {tuple(w_fp8.shape)} has {math.prod(w_fp8.shape):,} one-byte elements: JAX's Triton "
                f"lowering addresses it with 32-bit element offsets (64-bit only above 4 GiB), which wrap past "
                f"2**31 - 1 (split the experts)")
    return None


def _element_offsets_wrap(shape, dtype) -> bool:
    """True when JAX's Pallas→Triton lowering (jax 0.11.2: `_compute_offsets_from_indices`) would
    address an array of `shape` / `dtype` with int32 element offsets that overflow: it picks 64-bit
    offsets only when the array is over 2**32 bytes, but offsets count elements, so arrays of
    1-byte elements between 2**31 and 2**32 elements (2–4 GiB of fp8) wrap. Wider dtypes cannot:
    2**32 bytes hold at most 2**31 two-byte elements."""
    n = math.prod(int(d) for d in shape)
    return n - 1 > 2**31 - 1 and n * jnp.dtype(dtype).itemsize <= 2**32


def _tile_dot(xt, wt, dt, prec):
    """x tile `[bm, bk]` · fp8 weight tile `[bk, bn]` converted to `dt` in registers → fp32."""
    return lax.dot_general(xt.astype(dt), wt.astype(dt), (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _scale(s_ref, kb, n0, cols, *, N: int, bn: int, scalar: bool, lead=()):
    """The fp32 scale(s) of k-block `kb` for this column tile: a scalar (tile inside one scale
    block) or a `[1, block_n]` row (`scale_inv[kb, col // bn]`)."""
    if scalar:
        return s_ref[(*lead, kb, n0 // bn)]
    nb = jnp.minimum(cols, N - 1) // bn
    return plgpu.load(s_ref.at[(*lead, kb, nb)])[None, :]


def _dense_kernel(x_ref, w_ref, s_ref, o_ref, *, M: int, N: int, bk: int, bn: int, block_m: int, block_n: int,
                  k_steps: int, scalar: bool, dt, prec, split: bool):
    m0 = pl.program_id(0) * block_m
    n0 = pl.program_id(1) * block_n
    kb0 = pl.program_id(2) * k_steps
    rows = m0 + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    cols = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    rmask = rows < M
    cmask = cols < N

    def body(t, acc):
        kb = kb0 + t
        k0 = pl.multiple_of(kb * bk, bk)
        xt = plgpu.load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, bk)], mask=rmask[:, None], other=0.0)
        wt = plgpu.load(w_ref.at[pl.ds(k0, bk), pl.ds(n0, block_n)], mask=cmask[None, :], other=0.0)
        return acc + _tile_dot(xt, wt, dt, prec) * _scale(s_ref, kb, n0, cols, N=N, bn=bn, scalar=scalar)

    acc = lax.fori_loop(0, k_steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    tile = (pl.ds(m0, block_m), pl.ds(n0, block_n))
    out = o_ref.at[(pl.program_id(2), *tile)] if split else o_ref.at[tile]  # one indexer (interpret mode)
    plgpu.store(out, acc.astype(o_ref.dtype), mask=rmask[:, None] & cmask[None, :])


@functools.partial(jax.jit, static_argnames=("block", "out_dtype", "block_m", "block_n", "split_k", "num_warps",
                                             "num_stages", "interpret"))
def fp8_matmul_pallas_triton(x: jax.Array, w_fp8: jax.Array, scale_inv: jax.Array, *, block: tuple[int, int],
                             out_dtype=None, block_m: int | None = None, block_n: int | None = None,
                             split_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
                             interpret: bool = False) -> jax.Array:
    """`x @ dequantise(w_fp8, scale_inv)` (Pallas/Triton, W8A16).

    Args:
      x: `[M, K]` bfloat16 or float32 (the api flattens leading axes).
      w_fp8: float8_e4m3fn `[K, N]`; scale_inv: float32 `[K/bk, ceil(N/bn)]`. block: `(bk, bn)`.
      out_dtype: result dtype (default x.dtype).
      block_m, block_n: output tile (None → `default_block_m(M)`, `default_block_n(bn, M)`).
      split_k: K splits (None → `auto_split_k`; 1: no split, no partials).
      num_warps, num_stages: Triton launch parameters.
      interpret: Pallas interpret mode (any backend; tests).
    Returns:
      `[M, N]` in out_dtype.
    Raises:
      NotImplementedError: configuration outside the module docstring's supported set.
    """
    reason = unsupported_reason(x, w_fp8, scale_inv, block=block, block_m=block_m, block_n=block_n,
                                split_k=split_k, interpret=interpret)
    if reason is not None:
        raise NotImplementedError(f"fp8_matmul pallas_triton: {reason}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    bk, bn = block
    M, K = x.shape
    N = w_fp8.shape[1]
    if M == 0 or N == 0 or K == 0:
        return jnp.zeros((M, N), out_dtype)
    bm = block_m or default_block_m(M)
    bnt = block_n or default_block_n(bn, M)
    k_blocks = K // bk
    grid_mn = (_cdiv(M, bm), _cdiv(N, bnt))
    splits = split_k or auto_split_k(grid_mn[0] * grid_mn[1], k_blocks, M, K)
    split = splits > 1
    dt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    prec = None if dt == jnp.bfloat16 else lax.Precision.HIGHEST
    kernel = functools.partial(_dense_kernel, M=M, N=N, bk=bk, bn=bn, block_m=bm, block_n=bnt,
                               k_steps=k_blocks // splits, scalar=bn % bnt == 0, dt=dt, prec=prec, split=split)
    out_shape = jax.ShapeDtypeStruct((splits, M, N) if split else (M, N), jnp.float32 if split else out_dtype)
    any_spec = pl.no_block_spec
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(*grid_mn, splits),
        in_specs=[any_spec, any_spec, any_spec],
        out_specs=any_spec,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_matmul",
    )(x, w_fp8, scale_inv.astype(jnp.float32))
    return jnp.sum(out, axis=0).astype(out_dtype) if split else out


def tile_metadata(group_sizes: jax.Array, M: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row tiles of the grouped kernel, from the traced `group_sizes [E]`.

    Returns int32 `(expert, row0, count)`, each `[cdiv(M, block_m) + E]`: tile t covers rows
    `[row0[t], row0[t] + count[t])` of expert `expert[t]`; the first Σ_e cdiv(g_e, block_m) tiles
    cover the groups in order (no tile for an empty group), the next ones cover the rows past
    Σ g_e with `expert = −1` (the kernel stores zeros there), the rest have count 0 (nothing to
    do). Groups are cut at M (ragged_dot: rows past M do not exist). The bound holds because
    Σ_e cdiv(g_e, bm) + cdiv(M − Σ g, bm) ≤ cdiv(M, bm) + E.
    """
    E = group_sizes.shape[0]
    T = _cdiv(M, block_m) + E
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), M)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    n_group_tiles = tile_end[-1]
    total = ends[-1]
    t = jnp.arange(T, dtype=jnp.int32)
    in_groups = t < n_group_tiles
    e = jnp.minimum(jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32), E - 1)
    local = t - tile_start[e]
    row0_g = starts[e] + local * block_m
    count_g = jnp.minimum(block_m, sizes[e] - local * block_m)
    row0_z = total + (t - n_group_tiles) * block_m
    count_z = jnp.clip(M - row0_z, 0, block_m)
    expert = jnp.where(in_groups, e, -1).astype(jnp.int32)
    row0 = jnp.where(in_groups, row0_g, row0_z).astype(jnp.int32)
    count = jnp.where(in_groups, count_g, count_z).astype(jnp.int32)
    return expert, row0, count


def _grouped_kernel(expert_ref, row0_ref, count_ref, x_ref, w_ref, s_ref, o_ref, *, N: int, bk: int, bn: int,
                    block_m: int, block_n: int, k_blocks: int, scalar: bool, dt, prec):
    t = pl.program_id(0)
    n0 = pl.program_id(1) * block_n
    e = expert_ref[t]
    r0 = row0_ref[t]
    count = count_ref[t]
    rmask = lax.broadcasted_iota(jnp.int32, (block_m,), 0) < count
    cols = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    cmask = cols < N
    omask = rmask[:, None] & cmask[None, :]
    out = o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)]

    @pl.when(e >= 0)
    def _():
        def body(kb, acc):
            k0 = pl.multiple_of(kb * bk, bk)
            xt = plgpu.load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, bk)], mask=rmask[:, None], other=0.0)
            wt = plgpu.load(w_ref.at[e, pl.ds(k0, bk), pl.ds(n0, block_n)], mask=cmask[None, :], other=0.0)
            return acc + _tile_dot(xt, wt, dt, prec) * _scale(s_ref, kb, n0, cols, N=N, bn=bn, scalar=scalar,
                                                              lead=(e,))

        acc = lax.fori_loop(0, k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(out, acc, mask=omask)

    @pl.when((e < 0) & (count > 0))
    def _():
        plgpu.store(out, jnp.zeros((block_m, block_n), jnp.float32), mask=omask)


@functools.partial(jax.jit, static_argnames=("block", "block_m", "block_n", "num_warps", "num_stages", "interpret"))
def fp8_grouped_matmul_pallas_triton(x: jax.Array, w_fp8: jax.Array, scale_inv: jax.Array, group_sizes: jax.Array,
                                     *, block: tuple[int, int], block_m: int | None = None,
                                     block_n: int | None = None, num_warps: int = 4, num_stages: int = 3,
                                     interpret: bool = False) -> jax.Array:
    """MoE expert matmul over fp8 expert weights (Pallas/Triton), `lax.ragged_dot` semantics.

    Args:
      x: `[M, K]` bfloat16 or float32, rows sorted by expert.
      w_fp8: float8_e4m3fn `[E, K, N]`; scale_inv: float32 `[E, K/bk, ceil(N/bn)]`. block: `(bk, bn)`.
      group_sizes: int32 `[E]` (traced; zeros allowed; Σ ≤ M, rows past Σ give 0).
      block_m, block_n: tile (None → `default_block_m(ceil(M / E))`, `default_block_n(bn, M)`).
      num_warps, num_stages: Triton launch parameters. interpret: Pallas interpret mode.
    Returns:
      float32 `[M, N]`.
    Raises:
      NotImplementedError: configuration outside the module docstring's supported set.
    """
    reason = unsupported_reason(x, w_fp8, scale_inv, block=block, block_m=block_m, block_n=block_n, grouped=True,
                                interpret=interpret)
    if reason is not None:
        raise NotImplementedError(f"fp8_grouped_matmul pallas_triton: {reason}")
    bk, bn = block
    M, K = x.shape
    E, _, N = w_fp8.shape
    if M == 0 or N == 0 or K == 0 or E == 0:
        return jnp.zeros((M, N), jnp.float32)
    bm = block_m or default_block_m(_cdiv(M, E))
    bnt = block_n or default_block_n(bn, M)
    expert, row0, count = tile_metadata(group_sizes, M, bm)
    dt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    prec = None if dt == jnp.bfloat16 else lax.Precision.HIGHEST
    kernel = functools.partial(_grouped_kernel, N=N, bk=bk, bn=bn, block_m=bm, block_n=bnt, k_blocks=K // bk,
                               scalar=bn % bnt == 0, dt=dt, prec=prec)
    any_spec = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        grid=(expert.shape[0], _cdiv(N, bnt)),
        in_specs=[any_spec] * 6,
        out_specs=any_spec,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_grouped_matmul",
    )(expert, row0, count, x, w_fp8, scale_inv.astype(jnp.float32))
