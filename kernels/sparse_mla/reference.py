"""Sparse MLA in the absorbed (MQA) form over the paged latent cache — pure-JAX reference.

Maths (DeepSeek-V3.2 DSA, GLM-5.x; docs/design.md §3.2): for query token t and head n,

    score[t,n,k] = q_abs[t,n,:] · kv[slot[t,k], :] * scale        (A+R wide, fp32)
    p            = softmax_k(score) over valid k                   (valid: slot not −1 / null)
    o_lat[t,n]   = Σ_k p[t,n,k] · kv[slot[t,k], :A]                 (A wide)
    lse[t,n]     = logsumexp_k score[t,n,k]  (natural log; −inf for a row with no valid k)

The reduction order over k depends only on the order of `topk_slots` (the top-k positions), not
on where rows live, so a row read from a hot slot gives the same result as the same row read in
place. Rows may be any row dtype of `kernels/paged` (float32, bfloat16, `fp8_ds_mla`); they are
dequantised to fp32 on read (`read_cache`) and every product accumulates in fp32.
Peak temporaries: `[t_chunk, K, A+R]` gathered rows plus `[t_chunk, N, K]` scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.paged.layout import GroupLayout
from kernels.paged.ops import read_cache, slot_valid


def _attend_chunk(q_TNC, slots_TK, kv_arena, layout, component, layer, kv_lora_rank, scale):
    valid_TK = slot_valid(slots_TK, layout.tokens_per_page)
    kv_TKC = read_cache(kv_arena, slots_TK, layout, component, layer)
    kv_TKC = jnp.where(valid_TK[..., None], kv_TKC, 0.0)  # never let garbage (NaN bits) through
    s_TNK = jnp.einsum("tnc,tkc->tnk", q_TNC.astype(jnp.float32), kv_TKC,
                       precision=lax.Precision.HIGHEST) * scale
    s_TNK = jnp.where(valid_TK[:, None, :], s_TNK, -jnp.inf)
    m_TN = jnp.max(s_TNK, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m_TN), m_TN, 0.0)
    e_TNK = jnp.exp(s_TNK - m_safe[..., None])
    denom_TN = jnp.sum(e_TNK, axis=-1)
    o_TNA = jnp.einsum("tnk,tka->tna", e_TNK, kv_TKC[..., :kv_lora_rank], precision=lax.Precision.HIGHEST)
    o_TNA = o_TNA / jnp.where(denom_TN > 0, denom_TN, 1.0)[..., None]
    lse_TN = jnp.where(denom_TN > 0, m_safe + jnp.log(jnp.where(denom_TN > 0, denom_TN, 1.0)), -jnp.inf)
    return o_TNA, lse_TN


@functools.partial(jax.jit, static_argnames=("layout", "component", "kv_lora_rank", "scale", "t_chunk"))
def sparse_mla_reference(
    q_TNC: jax.Array,
    kv_arena: jax.Array,
    topk_slots_TK: jax.Array,
    layer: jax.Array | int,
    *,
    layout: GroupLayout,
    component: str = "mla",
    kv_lora_rank: int,
    scale: float,
    t_chunk: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed sparse MLA over selected cache slots.

    Args:
      q_TNC: absorbed queries `[T, N, A+R]` (`[W_UK^T q_nope | q_pe]`), any float dtype.
      kv_arena: `uint32[num_blocks, page_words]`; the `component` rows of `layer` hold
        `[c_kv (A) | k_pe (R)]`.
      topk_slots_TK: int32 `[T, K]` cache slots to attend (−1 or null-block slots = none).
      layer: layer index inside the component (may be traced).
      kv_lora_rank: A. scale: softmax scale (qk_head_dim^-0.5).
      t_chunk: query rows processed at once (bounds temporaries).
    Returns:
      o_lat `float32[T, N, A]` (0 for an empty row) and lse `float32[T, N]` (natural log, −inf for
      an empty row; never NaN).
    """
    T = q_TNC.shape[0]
    tc = max(1, min(t_chunk, T))
    pad = (-T) % tc
    q = jnp.pad(q_TNC, ((0, pad), (0, 0), (0, 0)))
    s = jnp.pad(topk_slots_TK, ((0, pad), (0, 0)), constant_values=-1)
    nc = (T + pad) // tc
    q = q.reshape(nc, tc, *q.shape[1:])
    s = s.reshape(nc, tc, s.shape[-1])
    o, lse = lax.map(
        lambda args: _attend_chunk(args[0], args[1], kv_arena, layout, component, layer, kv_lora_rank, scale),
        (q, s),
    )
    o = o.reshape(nc * tc, *o.shape[2:])[:T]
    lse = lse.reshape(nc * tc, -1)[:T]
    return o, lse
