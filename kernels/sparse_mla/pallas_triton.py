"""Sparse MLA (absorbed / MQA form) as a Pallas kernel lowered through Triton.

Same contract as `reference.sparse_mla_reference` (read that docstring for the maths): absorbed
queries `q [T, N, A+R]` attend to the latent rows at `topk_slots [T, K]` of the paged arena and
give `o_lat float32[T, N, A]` and `lse float32[T, N]` (natural log, −inf for a row with no valid
slot, never NaN). Decode (T = batch) and prefill (T = all new tokens of a ragged batch) are the
same call: every query token carries its own K slots.

Kernel (one program per (token t, block of `block_h` heads, key split)):
  * the program walks its split's range of the token's K slots in blocks of `block_k`, in list
    order (one split: all K; several: `combine_splits` merges the partial results);
  * for each block it loads the slots, turns each into (block = slot // tpp, token o = slot % tpp)
    and gathers the row's pieces straight from the arena (`kv_arena uint32[num_blocks,
    page_words]`, one masked load per piece at `row_base + constant + o · stride`,
    `kernels.pallas_rows.piece_addressing`; −1 and null-block slots are masked, never read);
  * the words are decoded by the row dtype's codec (`kernels.pallas_rows`) into float32 lanes
    (fp8_ds_mla: e4m3 codes · their tile's fp32 scale, bf16 rope; dequantised in registers, the
    same values the reference's `read_cache` gives);
  * scores `q·k · scale` (sum of per-lane dots over the latent and rope lanes) update an online
    softmax (running max m, running sum l, accumulator acc [block_h, A]) with fp32 state.

Reduction order: blocks are visited in top-k list order and, inside a block, the dots and sums
run over the block's list positions. Nothing in the order depends on the slot values (they only
form addresses), so the same rows at other slots (a HiSparse hot buffer instead of their resident
pages) give bit-identical outputs. The order differs from the reference's (one softmax over all K
at once), so Pallas and reference agree to rounding, not bitwise. With `num_splits` > 1 the list
is cut into equal contiguous ranges (by list position) whose partial results are merged in range
order; the automatic split count depends on T and the head count, so a caller that needs the same
bits for one token across different batch sizes passes `num_splits` explicitly.

Precision (`precision=`):
  "highest"  fp32 operands, IEEE fp32 dots (Triton `input_precision=ieee`): the reference's
             maths to rounding. The default.
  "bf16"     queries, rows and probabilities rounded to bf16 for the tensor cores, fp32
             accumulation: the production speed path (bf16 rows are exact in it; the queries and
             the probabilities lose bits, ~1e-2 relative).

Supported (else NotImplementedError, which the dispatch turns into the reference): row dtypes
with a codec in `kernels.pallas_rows` (float32, bfloat16, fp8_ds_mla); A / L and R / L powers of
two and ≥ 16 (Triton's dot and its power-of-two tensor sizes; L = values per word: 4 for the
fp8 latent, 2 for its bf16 rope; at A = 512, R = 64: 128 and 32); `block_k`, `block_h` powers of
two ≥ 16. Heads are padded to a power of two ≥ 16 and K to a multiple of `block_k` with −1.
A new row dtype needs only a codec in `kernels.pallas_rows`: the kernel loads whatever pieces
the codec names (fp8_ds_mla: latent codes, one word per tile scale, rope).

JAX 0.11 marks the Pallas Triton backend deprecated in favour of Mosaic GPU (a warning at
lowering); the kernel keeps to the plain load/dot/reduce subset that both lower.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.paged.layout import GroupLayout
from kernels.pallas_rows import (RowCodec, from_lanes, is_power_of_two, mla_row_codec, next_power_of_two,
                                 piece_addressing, to_lanes, word_alignment)

PRECISIONS = ("highest", "bf16")


def unsupported_reason(layout: GroupLayout, component: str, kv_lora_rank: int, *, block_k: int = 64,
                       block_h: int = 64, precision: str = "highest", interpret: bool = False) -> str | None:
    """Why this configuration cannot run on the Pallas kernel, or None when it can.

    Interpret mode drops the GPU-only minimum of 16 on lane widths (tests use tiny rows).
    """
    try:
        _, comp = layout.component(component)
    except KeyError as e:
        return str(e)
    R = comp.width - kv_lora_rank
    if R <= 0:
        return f"row width {comp.width} must exceed kv_lora_rank {kv_lora_rank}"
    try:
        codec = mla_row_codec(comp.row_dtype, kv_lora_rank, R)
    except NotImplementedError as e:
        return str(e)
    for _, _, n in codec.segments:
        if not is_power_of_two(n):
            return f"a row piece of {n} words is not a power of two"
    min_lane = 1 if interpret else 16
    for width, L, name in ((kv_lora_rank, codec.part_lanes[0], "A"), (R, codec.part_lanes[1], "R")):
        if not is_power_of_two(width // L) or width // L < min_lane:
            return f"{name}/{L} = {width // L} must be a power of two >= {min_lane}"
    if not (is_power_of_two(block_k) and block_k >= 16 and is_power_of_two(block_h) and block_h >= 16):
        return f"block_k={block_k}, block_h={block_h} must be powers of two >= 16"
    if precision not in PRECISIONS:
        return f"precision {precision!r} not in {PRECISIONS}"
    return None


def _dot(a, b, b_contract: int, precision):
    """a [M, C] · b (contracted on axis `b_contract`: [N, C] → 1, [C, N] → 0) → float32 [M, N];
    bf16 operands on tensor cores for precision "bf16", IEEE fp32 (HIGHEST) otherwise."""
    if precision == "bf16":
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        prec = None
    else:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        prec = lax.Precision.HIGHEST
    return lax.dot_general(a, b, (((1,), (b_contract,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _dot_nt(a, b, precision):
    """a [M, C] · b [N, C]ᵀ → float32 [M, N]."""
    return _dot(a, b, 1, precision)


def _dot_nn(a, b, precision):
    """a [M, K] · b [K, N] → float32 [M, N]."""
    return _dot(a, b, 0, precision)


def _kernel(row_base_ref, slots_ref, *refs, codec: RowCodec, pieces: tuple, n_lat: int, n_rope: int, tpp: int,
            num_blocks: int, block_k: int, blocks_per_split: int, scale: float, precision: str, align: int):
    q_lat_refs = refs[:n_lat]
    q_rope_refs = refs[n_lat:n_lat + n_rope]
    arena_ref = refs[n_lat + n_rope]
    o_refs = refs[n_lat + n_rope + 1:n_lat + n_rope + 1 + n_lat]
    lse_ref = refs[-1]

    row_base = row_base_ref[0]
    if align > 1:
        row_base = pl.multiple_of(row_base, align)  # proven by the wrapper's static strides
    first_block = pl.program_id(2) * blocks_per_split
    q_lat = [r[...] for r in q_lat_refs]
    q_rope = [r[...] for r in q_rope_refs]
    bh = q_lat[0].shape[0]
    iotas = [lax.broadcasted_iota(jnp.int32, (1, n), 1) for _, _, n in pieces]

    def body(i, carry):
        m, l, accs = carry
        slots = slots_ref[pl.ds((first_block + i) * block_k, block_k)]
        valid = (slots >= tpp) & (slots < num_blocks * tpp)  # −1, null block, out of range: absent
        safe = jnp.where(valid, slots, 0)
        blk = (safe // tpp)[:, None]
        o = safe % tpp
        segs = [
            plgpu.load(arena_ref.at[blk, (row_base + const + o * stride)[:, None] + iota], mask=valid[:, None],
                       other=0)
            for (const, stride, _), iota in zip(pieces, iotas)
        ]
        lat, rope = codec.decode(*segs)  # float32 lanes [block_k, A/L], [block_k, R/L]
        s = _dot_nt(q_lat[0], lat[0], precision)
        for qa, ka in zip(q_lat[1:], lat[1:]):
            s = s + _dot_nt(qa, ka, precision)
        for qr, kr in zip(q_rope, rope):
            s = s + _dot_nt(qr, kr, precision)
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)  # [bh, block_k]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        l = l * alpha + jnp.sum(p, axis=1)
        accs = tuple(acc * alpha[:, None] + _dot_nn(p, v, precision) for acc, v in zip(accs, lat))
        return m_new, l, accs

    m0 = jnp.full((bh,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((bh,), jnp.float32)
    acc0 = tuple(jnp.zeros((bh, q.shape[1]), jnp.float32) for q in q_lat)
    m, l, accs = lax.fori_loop(0, blocks_per_split, body, (m0, l0, acc0))
    nonempty = l > 0
    inv = 1.0 / jnp.where(nonempty, l, 1.0)
    for o_ref, acc in zip(o_refs, accs):
        o_ref[...] = acc * inv[:, None]
    lse_ref[...] = jnp.where(nonempty, jnp.where(nonempty, m, 0.0) + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)


def combine_splits(o_TSNA: jax.Array, lse_TSN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge partial softmax results over disjoint key splits (log-sum-exp weights).

    `o_TSNA` float32 `[T, S, N, A]` and `lse_TSN` `[T, S, N]` (−inf for an empty split) → `o [T, N, A]`,
    `lse [T, N]` (−inf, o = 0 when every split is empty). Splits are summed in index order.
    """
    m = jnp.max(lse_TSN, axis=1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(lse_TSN - m_safe[:, None])  # 0 for empty splits
    total = jnp.sum(e, axis=1)
    nonempty = total > 0
    lse = jnp.where(nonempty, m_safe + jnp.log(jnp.where(nonempty, total, 1.0)), -jnp.inf)
    w = e / jnp.where(nonempty, total, 1.0)[:, None]
    return jnp.sum(w[..., None] * o_TSNA, axis=1), lse


def auto_num_splits(T: int, head_blocks: int, k_blocks: int, max_splits: int | None = None,
                    target_programs: int = 264) -> int:
    """Key splits so that T · head_blocks · splits reaches `target_programs` (two per SM of a
    132-SM H200): a power of two, at most `k_blocks` (each split keeps ≥ 1 block of keys) and at
    most `max_splits` (the caller's cap on the partial-output traffic)."""
    want = max(1, -(-target_programs // max(1, T * head_blocks)))
    cap = min(k_blocks, max_splits or k_blocks)
    cap = 1 << (max(1, cap).bit_length() - 1)  # largest power of two <= cap
    return min(next_power_of_two(want), cap)


@functools.partial(
    jax.jit,
    static_argnames=("layout", "component", "kv_lora_rank", "scale", "block_k", "block_h", "num_splits", "num_warps",
                     "num_stages", "precision", "interpret"),
)
def sparse_mla_pallas_triton(
    q_TNC: jax.Array,
    kv_arena: jax.Array,
    topk_slots_TK: jax.Array,
    layer: jax.Array | int,
    *,
    layout: GroupLayout,
    component: str = "mla",
    kv_lora_rank: int,
    scale: float,
    block_k: int = 64,
    block_h: int = 64,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    precision: str = "highest",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed sparse MLA over selected cache slots (Pallas/Triton).

    Args:
      q_TNC: absorbed queries `[T, N, A+R]` float32 or bfloat16 (`[W_UK^T q_nope | q_pe]`).
      kv_arena: `uint32[num_blocks, page_words]`; the `component` rows of `layer` hold
        `[c_kv (A) | k_pe (R)]` in the component's row dtype.
      topk_slots_TK: int32 `[T, K]` cache slots (−1 / null-block / out-of-range slots = none).
      layer: layer index inside the component (int or traced int32 scalar).
      kv_lora_rank: A. scale: softmax scale.
      block_k: slots per online-softmax step. block_h: heads per program (capped at the padded
        head count). num_splits: programs sharing one token's K slots (contiguous ranges of the
        list, merged by `combine_splits`; None → `auto_num_splits`, which fills the GPU at small
        decode batches while the fp32 partials stay under a quarter of the row bytes). num_warps (None → 8 for ≥ 32 heads per program, else 4), num_stages:
        Triton launch parameters.
      precision: "highest" or "bf16" (module docstring).
      interpret: run the kernel in Pallas interpret mode (any backend; for tests).
    Returns:
      `(o_lat float32[T, N, A], lse float32[T, N])`.
    Raises:
      NotImplementedError: configuration outside the module docstring's supported set.
    """
    reason = unsupported_reason(layout, component, kv_lora_rank, block_k=block_k, block_h=block_h,
                                precision=precision, interpret=interpret)
    if reason is not None:
        raise NotImplementedError(f"sparse_mla pallas_triton: {reason}")
    base, comp = layout.component(component)
    T, N, C = q_TNC.shape
    A = kv_lora_rank
    if C != comp.width:
        raise ValueError(f"q width {C} != cache row width {comp.width}")
    codec = mla_row_codec(comp.row_dtype, A, C - A)
    if T == 0:
        return jnp.zeros((0, N, A), jnp.float32), jnp.zeros((0, N), jnp.float32)
    tpp = layout.tokens_per_page
    num_blocks = kv_arena.shape[0]

    Np = max(16, next_power_of_two(N))
    bh = min(block_h, Np)
    K = topk_slots_TK.shape[1]
    k_blocks = max(1, -(-K // block_k))
    if num_splits is None:
        # Each split writes fp32 partials [bh, A] that the combine reads back: keep them under a
        # quarter of the row bytes the split reads (rows ≥ 16 · bh · A / row_bytes per split).
        rows_min = -(-16 * bh * A // (4 * comp.row_words))
        splits = auto_num_splits(T, Np // bh, k_blocks, max_splits=max(1, (k_blocks * block_k) // rows_min))
    else:
        splits = num_splits
    per_split = -(-k_blocks // splits)
    Kp = per_split * splits * block_k
    q_dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    q = jnp.pad(q_TNC.astype(q_dtype), ((0, 0), (0, Np - N), (0, 0)))
    slots = jnp.pad(topk_slots_TK.astype(jnp.int32), ((0, 0), (0, Kp - K)), constant_values=-1)
    q_lat = to_lanes(q[..., :A], codec.part_lanes[0])
    q_rope = to_lanes(q[..., A:], codec.part_lanes[1])
    row_base = (base + jnp.asarray(layer, jnp.int32) * (tpp * comp.row_words)).astype(jnp.int32).reshape(1)

    if num_warps is None:
        num_warps = 8 if bh >= 32 else 4
    grid = (T, Np // bh, splits)
    in_spec = lambda w: pl.BlockSpec((None, bh, w), lambda t, h, s: (t, h, 0))  # noqa: E731
    out_spec = lambda w: pl.BlockSpec((None, None, bh, w), lambda t, h, s: (t, s, h, 0))  # noqa: E731
    in_specs = [
        pl.no_block_spec,
        pl.BlockSpec((None, Kp), lambda t, h, s: (t, 0)),
        *[in_spec(x.shape[-1]) for x in q_lat],
        *[in_spec(x.shape[-1]) for x in q_rope],
        pl.no_block_spec,
    ]
    out_shape = [jax.ShapeDtypeStruct((T, splits, Np, x.shape[-1]), jnp.float32) for x in q_lat]
    out_shape.append(jax.ShapeDtypeStruct((T, splits, Np), jnp.float32))
    out_specs = [out_spec(x.shape[-1]) for x in q_lat]
    out_specs.append(pl.BlockSpec((None, None, bh), lambda t, h, s: (t, s, h)))
    kernel = functools.partial(
        _kernel, codec=codec, pieces=piece_addressing(codec, comp.segments, tpp), n_lat=len(q_lat),
        n_rope=len(q_rope), tpp=tpp,
        num_blocks=num_blocks, block_k=block_k, blocks_per_split=per_split, scale=float(scale), precision=precision,
        align=word_alignment(base, tpp * comp.row_words))
    *o_lanes, lse = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_mla",
    )(row_base, slots, *q_lat, *q_rope, kv_arena)
    o = from_lanes(o_lanes)  # [T, splits, Np, A]
    if splits == 1:
        o, lse = o[:, 0], lse[:, 0]
    else:
        o, lse = combine_splits(o, lse)
    return o[:, :N], lse[:, :N]
