"""Lightning-indexer top-k with the scores computed by a Pallas kernel (Triton lowering).

Same contract, tie rule and outputs as `reference.indexer_topk_reference` (read that docstring
for the maths): fp32 scores `I[t, s] = Σ_j w[t, j] · ReLU(qI[t, j] · kI[s]) · Dk^-0.5` for
`s ≤ pos[t]`, top-k per query token with the total order (higher score, then lower position),
request-local positions with −1 padding, and the valid count.

Which part is Pallas:
  * PALLAS: `_scores_kernel`, one program per (query token, `block_s` key positions of the current
    key chunk). It looks the positions' pages up in the token's block-table row, gathers the key
    rows straight from the arena (`kv_arena uint32[num_blocks, page_words]`, masked loads: keys
    after the query's position, past the table, or in the null block are never read; fp8 keys
    load their code words from the page's key segment and their scale word from its scale
    segment), decodes them with the row dtype's codec (`kernels.pallas_rows`; fp8: e4m3 · the
    token's fp32 scale, as the reference dequantises), computes the `[I, block_s]` head
    dots with one matrix product per lane, applies ReLU, the head weights and the scale, and
    writes fp32 scores (−inf where masked) for the chunk.
  * JAX: the loops over query chunks (`lax.map`, `t_chunk` tokens) and key chunks
    (`lax.fori_loop`, `s_chunk` positions, stopping at the chunk's largest position), and the
    running top-k merge after each key chunk: `lax.sort` on (−score, position) with two keys,
    exactly the reference's selection, so equal scores give identical selections. Only chunk
    keys scoring strictly above the current k-th best can enter (`_merge`); when every row has
    few of them (≤ s_chunk/16 or ≤ s_chunk/4) they are packed into a small buffer first, so a
    long-context decode sorts `topk + 256` pairs per chunk instead of `topk + 4096`.

Peak temporaries per step: scores `float32[t_chunk, s_chunk]` plus the merge's
`[t_chunk, topk + s_chunk]` (score, position) pairs and the sort's workspace — with the defaults
(64 × 4096, K = 2048) under 4 MiB, never `[T, heads, S]`. A 32K × 32K prefill runs 512 query
chunks of 8 key chunks each inside those bounds.

Scores agree with the reference's to fp32 rounding (the dot's summation order differs), so a
selection can differ from the reference's only between keys whose scores differ by rounding;
inputs whose dots are exact in fp32 (the tests' small integers) give identical selections.

Precision: "highest" (fp32 operands, IEEE dots; default) or "bf16" (queries and keys rounded to
bf16 for the tensor cores, fp32 accumulation). Supported (else NotImplementedError): row dtypes
with a codec (float32, bfloat16, fp8_per_token, fp8_per_token_hadamard); I a power of two (≥ 16
on GPU); Dk / L a power of two (≥ 16 on GPU; L = 4 for fp8, so Dk = 128 gives 32); `block_s` a
power of two ≥ 16 dividing `s_chunk`. Hadamard keys: the queries are rotated into the key basis
(`to_key_basis`, one `[T, I, Dk] × [Dk, Dk]` product) before the kernel, which never sees H.
`return_scores=True` also returns the selected scores (the merge keeps them anyway).

Known cost: each program reads its own token's keys, so the many query tokens of one request in
a prefill re-read the same keys (served from L2 when they run close together); a tile of tokens
of one request sharing one key load is the next step for prefill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.paged.layout import GroupLayout
from kernels.paged.ops import to_key_basis
from kernels.pallas_rows import RowCodec, is_power_of_two, key_row_codec, piece_addressing, to_lanes, word_alignment

PRECISIONS = ("highest", "bf16")
_BIG = jnp.iinfo(jnp.int32).max


def unsupported_reason(layout: GroupLayout, component: str, num_heads: int, *, block_s: int = 64,
                       s_chunk: int = 4096, precision: str = "highest", interpret: bool = False) -> str | None:
    """Why this configuration cannot run on the Pallas kernel, or None when it can."""
    try:
        _, comp = layout.component(component)
        codec = key_row_codec(comp.row_dtype, comp.width)
    except (KeyError, NotImplementedError) as e:
        return str(e)
    min_dot = 1 if interpret else 16
    L = codec.part_lanes[0]
    if any(not is_power_of_two(n) for _, _, n in codec.segments) or comp.width // L < min_dot:
        return f"key lane width {comp.width // L} must be a power of two >= {min_dot}"
    if not is_power_of_two(num_heads) or num_heads < min_dot:
        return f"indexer heads {num_heads} must be a power of two >= {min_dot}"
    if not (is_power_of_two(block_s) and block_s >= 16 and s_chunk % block_s == 0):
        return f"block_s={block_s} must be a power of two >= 16 dividing s_chunk={s_chunk}"
    if precision not in PRECISIONS:
        return f"precision {precision!r} not in {PRECISIONS}"
    return None


def _scores_kernel(chunk_start_ref, row_base_ref, req_ref, pos_ref, w_ref, *refs, codec: RowCodec, pieces: tuple,
                   n_lanes: int, tpp: int, pages: int, block_s: int, scale: float, precision: str, align: int):
    q_refs = refs[:n_lanes]
    bt_ref, arena_ref, out_ref = refs[n_lanes:]
    t = pl.program_id(0)
    j = pl.program_id(1)
    req = req_ref[t]
    pos = pos_ref[t]
    s = chunk_start_ref[0] + j * block_s + lax.broadcasted_iota(jnp.int32, (block_s,), 0)
    page = s // tpp
    in_table = (s <= pos) & (page < pages)
    blk = plgpu.load(bt_ref.at[req, jnp.where(in_table, page, 0)], mask=in_table, other=0)
    valid = in_table & (blk > 0)
    row_base = row_base_ref[0]
    if align > 1:
        row_base = pl.multiple_of(row_base, align)  # proven by the wrapper's static strides
    o = s % tpp
    blk_col = jnp.where(valid, blk, 0)[:, None]
    words = [
        plgpu.load(arena_ref.at[blk_col, (row_base + const + o * stride)[:, None]
                                + lax.broadcasted_iota(jnp.int32, (1, n), 1)], mask=valid[:, None], other=0)
        for const, stride, n in pieces
    ]
    (k_lanes,) = codec.decode(*words)  # float32 [block_s, Dk/L] each
    dt = jnp.bfloat16 if precision == "bf16" else jnp.float32
    prec = None if precision == "bf16" else lax.Precision.HIGHEST
    dots = None
    for q_ref, k in zip(q_refs, k_lanes):
        d = lax.dot_general(q_ref[...].astype(dt), k.astype(dt), (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)  # [I, block_s]
        dots = d if dots is None else dots + d
    w = w_ref[...].astype(jnp.float32)
    score = jnp.sum(w[:, None] * jnp.maximum(dots, 0.0), axis=0) * scale
    score = jnp.where(score == 0, 0.0, score)  # −0.0 ties with +0.0 (the sort orders them otherwise)
    out_ref[...] = jnp.where(valid, score, -jnp.inf)


def chunk_scores(q_lanes, w_TI, req_T, pos_T, block_table_BP, kv_arena, row_base, chunk_start, *, layout, comp,
                 s_chunk, block_s, num_warps, num_stages, precision, interpret, base=None):
    """PALLAS: fp32 scores `[Tc, s_chunk]` of keys `chunk_start + [0, s_chunk)` (−inf where masked)."""
    Tc, I = w_TI.shape
    codec = key_row_codec(comp.row_dtype, comp.width)
    kernel = functools.partial(
        _scores_kernel, codec=codec, pieces=piece_addressing(codec, comp.segments, layout.tokens_per_page),
        n_lanes=len(q_lanes), tpp=layout.tokens_per_page,
        pages=block_table_BP.shape[1], block_s=block_s, scale=comp.width ** -0.5, precision=precision,
        align=1 if base is None else word_alignment(base, layout.tokens_per_page * comp.row_words))
    any_spec = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Tc, s_chunk), jnp.float32),
        grid=(Tc, s_chunk // block_s),
        in_specs=[any_spec, any_spec, any_spec, any_spec, pl.BlockSpec((None, I), lambda t, j: (t, 0)),
                  *[pl.BlockSpec((None, I, q.shape[-1]), lambda t, j: (t, 0, 0)) for q in q_lanes],
                  any_spec, any_spec],
        out_specs=pl.BlockSpec((None, block_s), lambda t, j: (t, j)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="indexer_scores",
    )(chunk_start.reshape(1), row_base, req_T, pos_T, w_TI, *q_lanes, block_table_BP, kv_arena)


def _sort_merge(best_neg, best_pos, neg, pos, topk):
    """The `topk` smallest (−score, position) pairs of (running best ∪ candidates): one two-key sort."""
    ns, ps = lax.sort((jnp.concatenate([best_neg, neg], -1), jnp.concatenate([best_pos, pos], -1)),
                      dimension=-1, num_keys=2)
    return ns[..., :topk], ps[..., :topk]


def _compact(neg, pos, keep, cap):
    """Per row, the `keep` entries (at most `cap` of them, in column order) packed into `[Tc, cap]`
    buffers padded with (inf, _BIG)."""
    Tc = neg.shape[0]
    slot = jnp.where(keep, jnp.cumsum(keep, axis=-1) - 1, cap)  # cap: out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(Tc)[:, None], neg.shape)
    buf_n = jnp.full((Tc, cap), jnp.inf, neg.dtype).at[rows, slot].set(neg, mode="drop")
    buf_p = jnp.full((Tc, cap), _BIG, pos.dtype).at[rows, slot].set(pos, mode="drop")
    return buf_n, buf_p


def merge_caps(s_chunk: int, topk: int) -> tuple[int, ...]:
    """Candidate-buffer sizes of `_merge`'s cheap tiers (s_chunk/16, s_chunk/4; none ≥ s_chunk)."""
    return tuple(sorted({c for c in (s_chunk // 16, s_chunk // 4) if 1 <= c < s_chunk}))


def _merge(best_neg, best_pos, score_TS, pos_S, topk, caps=()):
    """JAX: keep the `topk` best of (running best ∪ chunk) by (higher score, lower position).

    Threshold merge: every running-best position is below every chunk position (chunks go in
    position order), so a chunk key enters the top-k only if its score is STRICTLY above the
    current k-th best score (on an equal score the earlier, kept key wins; while fewer than
    `topk` are kept the threshold is −inf: every valid key is a candidate). If every row has at
    most `cap` candidates (the smallest such cap in `caps`), they are packed into a `[Tc, cap]`
    buffer and sorted with the running best (`topk + cap` wide instead of `topk + s_chunk`);
    otherwise the full two-key sort runs. Either way the selection is exactly the full sort's.
    """
    valid = score_TS > -jnp.inf
    neg = jnp.where(valid, -score_TS, jnp.inf)
    pos = jnp.where(valid, jnp.broadcast_to(pos_S[None, :], score_TS.shape), _BIG)
    if not caps:
        return _sort_merge(best_neg, best_pos, neg, pos, topk)
    keep = neg < best_neg[:, topk - 1:topk]  # score > k-th best score (inf: not full yet → all valid)
    n_max = jnp.max(jnp.sum(keep, axis=-1))
    def packed(cap):
        return lambda bn, bp, n, p, k: _sort_merge(bn, bp, *_compact(n, p, k, cap), topk)

    branches = [packed(c) for c in caps] + [lambda bn, bp, n, p, k: _sort_merge(bn, bp, n, p, topk)]
    tier = jnp.sum(n_max > jnp.asarray(caps, jnp.int32)).astype(jnp.int32)  # first cap that holds n_max
    return lax.switch(tier, branches, best_neg, best_pos, neg, pos, keep)


@functools.partial(
    jax.jit,
    static_argnames=("layout", "component", "topk", "t_chunk", "s_chunk", "block_s", "num_warps", "num_stages",
                     "precision", "return_scores", "threshold_merge", "interpret"),
)
def indexer_topk_pallas_triton(
    q_TID: jax.Array,
    w_TI: jax.Array,
    kv_arena: jax.Array,
    block_table_BP: jax.Array,
    req_idx_T: jax.Array,
    positions_T: jax.Array,
    layer: jax.Array | int,
    *,
    layout: GroupLayout,
    component: str = "indexer",
    topk: int,
    t_chunk: int = 64,
    s_chunk: int = 4096,
    block_s: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    precision: str = "highest",
    return_scores: bool = False,
    threshold_merge: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Top-k key positions per query token (Pallas scores, JAX merge).

    Args: as `reference.indexer_topk_reference` (queries in the model basis: for Hadamard key
      rows they are rotated here, outside the kernel), plus
      t_chunk, s_chunk: query tokens and key positions per step (bound the temporaries).
      block_s: key positions per program. num_warps, num_stages: Triton launch parameters.
      precision: "highest" or "bf16". interpret: Pallas interpret mode (any backend; for tests).
      return_scores: also return the selected fp32 scores (the DCP global merge needs them).
      threshold_merge: merge each key chunk through `_merge`'s threshold tiers (default) rather
        than always sorting `topk + s_chunk` pairs; same selections either way.
    Returns:
      topk_indices int32 `[T, topk]` (positions, tie rule, −1 padding) and valid int32 `[T]`;
      with `return_scores`, also scores float32 `[T, topk]` (−inf for padding; +0.0, never −0.0).
    Raises:
      NotImplementedError: configuration outside the supported set (module docstring).
    """
    T, I, Dk = q_TID.shape
    s_chunk = min(s_chunk, max(block_s, -(-block_table_BP.shape[1] * layout.tokens_per_page // block_s) * block_s))
    reason = unsupported_reason(layout, component, I, block_s=block_s, s_chunk=s_chunk, precision=precision,
                                interpret=interpret)
    if reason is not None:
        raise NotImplementedError(f"indexer_topk pallas_triton: {reason}")
    base, comp = layout.component(component)
    if Dk != comp.width:
        raise ValueError(f"query width {Dk} != key row width {comp.width}")
    if T == 0:
        out = (jnp.zeros((0, topk), jnp.int32), jnp.zeros((0,), jnp.int32))
        return out + (jnp.zeros((0, topk), jnp.float32),) if return_scores else out
    tpp = layout.tokens_per_page
    P = block_table_BP.shape[1]
    row_base = (base + jnp.asarray(layer, jnp.int32) * (tpp * comp.row_words)).astype(jnp.int32).reshape(1)
    tc = max(1, min(t_chunk, T))
    pad = (-T) % tc
    nc = (T + pad) // tc
    q_dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32

    def padded(x, value=0):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value).reshape(nc, tc, *x.shape[1:])

    codec = key_row_codec(comp.row_dtype, comp.width)
    q_key = to_key_basis(q_TID, comp.row_dtype)  # fp32; rotated like the stored keys (Hadamard rows)
    q_lanes = tuple(padded(x) for x in to_lanes(q_key.astype(q_dtype), codec.part_lanes[0]))
    # Padding rows: position −1 sees no key, so they never read the arena.
    args = (q_lanes, padded(w_TI.astype(jnp.float32)), padded(req_idx_T.astype(jnp.int32)),
            padded(positions_T.astype(jnp.int32), -1))
    max_chunks = -(-(P * tpp) // s_chunk)

    def one_chunk(a):
        ql, w, req, pos = a
        n_chunks = jnp.clip((jnp.max(pos) + s_chunk) // s_chunk, 0, max_chunks)

        def body(c, carry):
            start = (c * s_chunk).astype(jnp.int32)
            score = chunk_scores(ql, w, req, pos, block_table_BP, kv_arena, row_base, start, layout=layout, comp=comp,
                                 s_chunk=s_chunk, block_s=block_s, num_warps=num_warps, num_stages=num_stages,
                                 precision=precision, interpret=interpret, base=base)
            return _merge(*carry, score, start + jnp.arange(s_chunk, dtype=jnp.int32), topk,
                          merge_caps(s_chunk, topk) if threshold_merge else ())

        init = (jnp.full((tc, topk), jnp.inf, jnp.float32), jnp.full((tc, topk), _BIG, jnp.int32))
        best_neg, best_pos = lax.fori_loop(0, n_chunks, body, init)
        valid = best_pos != _BIG
        return (jnp.where(valid, best_pos, -1).astype(jnp.int32), jnp.sum(valid, axis=-1).astype(jnp.int32),
                jnp.where(valid, -best_neg, -jnp.inf))

    idx, valid, scores = lax.map(one_chunk, args)
    out = (idx.reshape(nc * tc, topk)[:T], valid.reshape(nc * tc)[:T])
    return out + (scores.reshape(nc * tc, topk)[:T],) if return_scores else out
