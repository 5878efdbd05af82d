"""Lightning-indexer scores and top-k selection over the paged indexer-key cache — pure JAX.

Maths (DeepSeek-V3.2 DSA as used by GLM-5.x; DESIGN §3.3), all in fp32:

    I[t, s] = Σ_j w[t, j] · ReLU(qI[t, j, :] · kI[s, :]) · Dk^-0.5,   for s ≤ pos[t], else −inf
    TopK_t  = the min(K, pos[t] + 1) highest I[t, ·]

Tie rule (a total order, relied on by the DCP global merge): higher score first, then LOWER
position first. Output: request-local positions `[T, K]` in that order, −1 padding, and the valid
count per row.

Memory: queries are processed `t_chunk` at a time and keys `s_chunk` at a time with a running
top-k merge, so temporaries are `O(t_chunk · (heads · s_chunk + K + s_chunk))` — never
`[T, heads, S]`. For each query chunk the key loop stops at the chunk's largest position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.paged.layout import GroupLayout
from kernels.paged.ops import read_cache

_BIG = jnp.iinfo(jnp.int32).max


def _select(neg_score, pos, k):
    """Sort rows by (neg_score, pos) ascending and keep the first k (total-order tie rule)."""
    ns, ps = lax.sort((neg_score, pos), dimension=-1, num_keys=2)
    return ns[..., :k], ps[..., :k]


def _topk_chunk(q_TID, w_TI, req_T, pos_T, block_table_BP, kv_arena, layer, layout, component, topk, s_chunk, scale):
    T = q_TID.shape[0]
    bt_TP = block_table_BP[req_T]
    tpp = layout.tokens_per_page
    P = bt_TP.shape[-1]
    q = q_TID.astype(jnp.float32)
    w = w_TI.astype(jnp.float32)
    n_chunks = (jnp.max(pos_T) + s_chunk) // s_chunk  # chunks covering positions 0..max(pos)
    n_chunks = jnp.clip(n_chunks, 0, (P * tpp + s_chunk - 1) // s_chunk)

    def body(c, carry):
        best_neg, best_pos = carry
        s_S = c * s_chunk + jnp.arange(s_chunk, dtype=jnp.int32)
        page = jnp.minimum(s_S // tpp, P - 1)
        block_TS = bt_TP[:, page]  # [T, S]
        slots_TS = block_TS * tpp + (s_S % tpp)[None, :]
        valid_TS = (s_S[None, :] <= pos_T[:, None]) & (block_TS > 0) & (s_S[None, :] < P * tpp)
        k_TSD = read_cache(kv_arena, jnp.where(valid_TS, slots_TS, -1), layout, component, layer)
        k_TSD = jnp.where(valid_TS[..., None], k_TSD, 0.0)
        dots = jnp.einsum("tid,tsd->tis", q, k_TSD, precision=lax.Precision.HIGHEST)
        score_TS = jnp.einsum("ti,tis->ts", w, jnp.maximum(dots, 0.0), precision=lax.Precision.HIGHEST) * scale
        neg = jnp.where(valid_TS, -score_TS, jnp.inf)
        pos = jnp.where(valid_TS, jnp.broadcast_to(s_S[None, :], valid_TS.shape), _BIG)
        return _select(jnp.concatenate([best_neg, neg], -1), jnp.concatenate([best_pos, pos], -1), topk)

    init = (jnp.full((T, topk), jnp.inf, jnp.float32), jnp.full((T, topk), _BIG, jnp.int32))
    best_neg, best_pos = lax.fori_loop(0, n_chunks, body, init)
    valid = best_pos != _BIG
    return (jnp.where(valid, best_pos, -1).astype(jnp.int32), jnp.sum(valid, axis=-1).astype(jnp.int32),
            jnp.where(valid, -best_neg, -jnp.inf))


@functools.partial(
    jax.jit, static_argnames=("layout", "component", "topk", "t_chunk", "s_chunk", "return_scores")
)
def indexer_topk_reference(
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
    s_chunk: int = 512,
    return_scores: bool = False,
) -> tuple[jax.Array, ...]:
    """Top-k key positions per query token from the paged indexer-key cache.

    Args:
      q_TID: indexer queries `[T, I, Dk]` (after RoPE), any float dtype.
      w_TI: per-head weights `[T, I]` (already scaled by I^-0.5).
      kv_arena: `uint32[num_blocks, page_words]`; the `component` rows of `layer` hold keys `[Dk]`.
      block_table_BP: int32 `[B, P]` block tables of the indexer group (0 = null block).
      req_idx_T: int32 `[T]` row of `block_table_BP` for each query token.
      positions_T: int32 `[T]` request-local position of each query (keys 0..pos are visible and
        must already be written). A padding row may use position 0 with an all-null table.
      layer: layer index inside the component (may be traced).
      topk: K.
      return_scores: also return the selected scores (the DCP global merge needs them).
    Returns:
      topk_indices int32 `[T, K]` (positions, tie rule above, −1 padding) and valid int32 `[T]`;
      with `return_scores`, also scores float32 `[T, K]` (−inf for padding).
    """
    T, _, Dk = q_TID.shape
    scale = Dk ** -0.5
    tc = max(1, min(t_chunk, T))
    pad = (-T) % tc
    nc = (T + pad) // tc

    def padded(x, value=0):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value).reshape(nc, tc, *x.shape[1:])

    args = (padded(q_TID), padded(w_TI), padded(req_idx_T), padded(positions_T))
    idx, valid, scores = lax.map(
        lambda a: _topk_chunk(*a, block_table_BP, kv_arena, layer, layout, component, topk, s_chunk, scale), args
    )
    out = (idx.reshape(nc * tc, topk)[:T], valid.reshape(nc * tc)[:T])
    return out + (scores.reshape(nc * tc, topk)[:T],) if return_scores else out
