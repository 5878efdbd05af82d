"""Lightning-indexer scores and top-k selection over the paged indexer-key cache — pure JAX.

Maths (DeepSeek-V3.2 DSA as used by GLM-5.x; docs/design.md §3.3), all in fp32:

    I[t, s] = Σ_j w[t, j] · ReLU(qI[t, j, :] · kI[s, :]) · Dk^-0.5,   for s ≤ pos[t], else −inf
    TopK_t  = the min(K, pos[t] + 1) highest I[t, ·]

Tie rule (a total order, relied on by the DCP global merge): higher score first, then LOWER
position first. Output: request-local positions `[T, K]` in that order, −1 padding, and the valid
count per row.

Key rows may be any row dtype of `kernels/paged` (float32, bfloat16, fp8 with a per-token scale,
dequantised to fp32 on read). For `fp8_per_token_hadamard` keys the queries are rotated by the
same Hadamard matrix as the stored keys (`to_key_basis`), which leaves q·k unchanged.

Chunking: queries `t_chunk` at a time (lax.map); for each query chunk, keys in chunks of `s_chunk`
positions (stopping at the chunk's largest position), each scored `s_block` keys at a time into
a `[t_chunk, s_chunk]` score buffer, then merged into the running top-k with one stable
`lax.top_k` over `[t_chunk, K + s_chunk]` (few large merges: XLA's CPU top-k costs ~5× less per
element on 4K-wide rows than on 512-wide ones). When every token of a query chunk belongs to one
request (prefill), each key block is gathered and decoded once for the whole chunk; otherwise per
token. Temporaries: `O(t_chunk · (s_chunk + K + heads · s_block + s_block · Dk))`, never
`[T, heads, S]`. Measured with XLA's compiled memory analysis for a 32K × 32K single-request
prefill (scripts/long_context.py): 23 MiB of temporaries at GLM-5.3's shapes (32 heads × 128,
top-k 2048, fp8 keys; 27 MiB with bf16 keys), beside the 256 MiB `[T, K]` output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.paged.layout import GroupLayout
from kernels.paged.ops import read_cache, to_key_basis

_BIG = jnp.iinfo(jnp.int32).max


def _merge(best_score, best_pos, score, pos, k):
    """Keep the k best of [best | new] by (higher score, lower position).

    Invariant: the running best holds only positions below every position of the new chunk, and
    its equal scores are in ascending position order; the new chunk is in ascending position
    order. So in the concatenation equal scores already stand in position order and a stable
    top-k (lower index first among equals) realises the tie rule.
    """
    s = jnp.concatenate([best_score, score], -1)
    p = jnp.concatenate([best_pos, pos], -1)
    top, idx = lax.top_k(s, k)
    return top, jnp.take_along_axis(p, idx, axis=-1)


def _topk_chunk(q_TID, w_TI, req_T, pos_T, block_table_BP, kv_arena, layer, layout, component, topk, s_chunk,
                s_block, scale):
    T = q_TID.shape[0]
    bt_TP = block_table_BP[req_T]
    tpp = layout.tokens_per_page
    P = bt_TP.shape[-1]
    row_dtype = layout.component(component)[1].row_dtype
    q = to_key_basis(q_TID, row_dtype)  # fp32; rotated like the stored keys (Hadamard rows)
    w = w_TI.astype(jnp.float32)
    n_keys = jnp.max(pos_T) + 1  # keys 0..max(pos) are needed by this query chunk
    n_chunks = jnp.clip((n_keys + s_chunk - 1) // s_chunk, 0, (P * tpp + s_chunk - 1) // s_chunk)
    blocks_per_chunk = s_chunk // s_block
    # Prefill chunks: gather each key once for all rows. Rows of another batch row whose block
    # table is empty (the step's padding rows) see no key on either path (`valid_TS`), so they
    # do not force the per-token gathers.
    one_request = jnp.all((req_T == req_T[0]) | ~jnp.any(bt_TP > 0, axis=-1))

    def keys(block, s):
        """Keys at positions s of pages `block` (same shape), zero where absent."""
        ok = (block > 0) & (s < P * tpp)
        k = read_cache(kv_arena, jnp.where(ok, block * tpp + s % tpp, -1), layout, component, layer,
                       stored_basis=True)
        return jnp.where(ok[..., None], k, 0.0)

    def shared_dots(s_S, page):
        k_SD = keys(bt_TP[0, page], s_S)
        return jnp.einsum("tid,sd->tis", q, k_SD, precision=lax.Precision.HIGHEST)

    def per_token_dots(s_S, page):
        k_TSD = keys(bt_TP[:, page], jnp.broadcast_to(s_S[None, :], (T, s_block)))
        return jnp.einsum("tid,tsd->tis", q, k_TSD, precision=lax.Precision.HIGHEST)

    def block_scores(b):
        """Scores `[T, s_block]` of keys b·s_block … (b+1)·s_block − 1; −inf where not visible."""
        s_S = b * s_block + jnp.arange(s_block, dtype=jnp.int32)
        page = jnp.minimum(s_S // tpp, P - 1)
        valid_TS = (s_S[None, :] <= pos_T[:, None]) & (bt_TP[:, page] > 0) & (s_S[None, :] < P * tpp)
        dots = lax.cond(one_request, shared_dots, per_token_dots, s_S, page)
        score_TS = jnp.einsum("ti,tis->ts", w, jnp.maximum(dots, 0.0), precision=lax.Precision.HIGHEST) * scale
        score_TS = jnp.where(score_TS == 0, 0.0, score_TS)  # −0.0 ties with +0.0
        return jnp.where(valid_TS, score_TS, -jnp.inf)

    def chunk(c, carry):
        first = c * blocks_per_chunk
        n_blocks = jnp.minimum(blocks_per_chunk, (n_keys + s_block - 1) // s_block - first)
        buf = lax.fori_loop(
            0, n_blocks,
            lambda j, buf: lax.dynamic_update_slice(buf, block_scores(first + j), (0, j * s_block)),
            jnp.full((T, s_chunk), -jnp.inf, jnp.float32))
        s_S = c * s_chunk + jnp.arange(s_chunk, dtype=jnp.int32)
        pos = jnp.where(jnp.isneginf(buf), _BIG, s_S[None, :])
        return _merge(*carry, buf, pos, topk)

    init = (jnp.full((T, topk), -jnp.inf, jnp.float32), jnp.full((T, topk), _BIG, jnp.int32))
    best_score, best_pos = lax.fori_loop(0, n_chunks, chunk, init)
    valid = best_pos != _BIG
    return (jnp.where(valid, best_pos, -1).astype(jnp.int32), jnp.sum(valid, axis=-1).astype(jnp.int32),
            jnp.where(valid, best_score, -jnp.inf))


@functools.partial(
    jax.jit, static_argnames=("layout", "component", "topk", "t_chunk", "s_chunk", "s_block", "return_scores")
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
    s_chunk: int = 4096,
    s_block: int = 512,
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
    # No chunk larger than the block tables can address (keeps short-context steps cheap).
    s_block = min(s_block, s_chunk)
    if s_chunk % s_block:
        raise ValueError(f"s_chunk {s_chunk} must be a multiple of s_block {s_block}")
    span = block_table_BP.shape[-1] * layout.tokens_per_page
    s_chunk = min(s_chunk, -(-span // s_block) * s_block)
    tc = max(1, min(t_chunk, T))
    pad = (-T) % tc
    nc = (T + pad) // tc

    def padded(x, value=0):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value).reshape(nc, tc, *x.shape[1:])

    args = (padded(q_TID), padded(w_TI), padded(req_idx_T), padded(positions_T))
    idx, valid, scores = lax.map(
        lambda a: _topk_chunk(*a, block_table_BP, kv_arena, layer, layout, component, topk, s_chunk, s_block, scale), args
    )
    out = (idx.reshape(nc * tc, topk)[:T], valid.reshape(nc * tc)[:T])
    return out + (scores.reshape(nc * tc, topk)[:T],) if return_scores else out
