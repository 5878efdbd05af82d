"""Collective building blocks of TP / EP / PCP / DCP, for use inside `jax.shard_map`.

Every function that communicates takes the mesh axis names it communicates over (`axes`, a tuple;
an empty tuple means "no communication"), so callers translate roles to axes once
(`ParallelLayout.axes(ROLE)`) and these stay layout-agnostic.

Maths sources: the log-sum-exp merge of partial softmax attention is the standard split-softmax
identity (FlashAttention's online softmax, FlashDecoding's split-KV merge); the top-k merge
relies on the indexer's total-order tie rule (docs/design.md §3.3: higher score first, then lower position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_BIG = jnp.iinfo(jnp.int32).max


# ---------------------------------------------------------------------- log-sum-exp merge
def lse_merge(o_RTNA: jax.Array, lse_RTN: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """Merge R partial attention results over disjoint key sets into one.

    lse = log Σ_r exp(lse_r), o = Σ_r exp(lse_r − lse) · o_r. NaN-safe: a partial with lse = −inf
    (no valid key on that rank) gets weight 0 whatever its o holds, and when every partial is empty
    the result is o = 0, lse = −inf (never −inf − −inf).

    Args:
      o_RTNA: partial outputs, the partial axis at `axis` (any trailing shape after lse's dims).
      lse_RTN: natural-log partial normalisers, same shape as o without its last dim.
    Returns:
      (o fp32 without the partial axis, lse fp32 without the partial axis).
    """
    lse = lse_RTN.astype(jnp.float32)
    m = jnp.max(lse, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m_safe), 0.0)
    denom = jnp.sum(w, axis=axis)
    o = jnp.sum(jnp.where(w[..., None] > 0, o_RTNA.astype(jnp.float32), 0.0) * w[..., None], axis=axis)
    ok = denom > 0
    o = o / jnp.where(ok, denom, 1.0)[..., None]
    lse_out = jnp.where(ok, jnp.squeeze(m_safe, axis) + jnp.log(jnp.where(ok, denom, 1.0)), -jnp.inf)
    return o, lse_out


def merge_partials_ag_rs(o_TNA: jax.Array, lse_TN: jax.Array, axes: tuple[str, ...], head_axis: int = 1):
    """DCP combine, all-gather + reduce-scatter backend (`--dcp-comm-backend ag_rs`).

    Each rank holds a partial `(o, lse)` for ALL heads over its KV shard. The (small) lse is
    all-gathered to form the global normaliser; each rank rescales its o by exp(lse_r − lse) and a
    reduce-scatter over the heads returns every rank the merged output of its own head slice.

    Returns (o `[T, N/R, A]` fp32, lse `[T, N/R]`).
    """
    if not axes:
        return o_TNA, lse_TN
    lse_all = lax.all_gather(lse_TN.astype(jnp.float32), axes, axis=0)  # [R, T, N]
    m = jnp.max(lse_all, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w_all = jnp.where(jnp.isfinite(lse_all), jnp.exp(lse_all - m_safe), 0.0)
    denom = jnp.sum(w_all, axis=0)
    ok = denom > 0
    lse_g = jnp.where(ok, m_safe + jnp.log(jnp.where(ok, denom, 1.0)), -jnp.inf)
    me = lax.axis_index(axes)
    w_me = jnp.where(ok, w_all[me] / jnp.where(ok, denom, 1.0), 0.0)
    o_w = jnp.where(w_me[..., None] > 0, o_TNA.astype(jnp.float32), 0.0) * w_me[..., None]
    o = lax.psum_scatter(o_w, axes, scatter_dimension=head_axis, tiled=True)
    n_local = o.shape[head_axis]
    lse_local = lax.dynamic_slice_in_dim(lse_g, me * n_local, n_local, axis=head_axis)
    return o, lse_local


def merge_partials_a2a(o_TNA: jax.Array, lse_TN: jax.Array, axes: tuple[str, ...], head_axis: int = 1):
    """DCP combine, all-to-all backend (`--dcp-comm-backend a2a`).

    Each rank sends head slice r of its partial `(o, lse)` to rank r (one all-to-all for o, one for
    lse); every rank then merges the R partials of its own heads locally with `lse_merge`.

    Returns (o `[T, N/R, A]` fp32, lse `[T, N/R]`).
    """
    if not axes:
        return o_TNA, lse_TN

    def by_dest(x):  # [.., N, ..] -> [R, .., N/R, ..] with the destination rank first
        shape = x.shape
        x = x.reshape(*shape[:head_axis], R, shape[head_axis] // R, *shape[head_axis + 1:])
        return jnp.moveaxis(x, head_axis, 0)

    R = axis_size(axes)
    o = lax.all_to_all(by_dest(o_TNA.astype(jnp.float32)), axes, split_axis=0, concat_axis=0, tiled=False)
    lse = lax.all_to_all(by_dest(lse_TN.astype(jnp.float32)), axes, split_axis=0, concat_axis=0, tiled=False)
    return lse_merge(o, lse, axis=0)  # axis 0 is now the source rank


def merge_partials(o_TNA, lse_TN, axes: tuple[str, ...], backend: str):
    """Dispatch on `--dcp-comm-backend` ("ag_rs" or "a2a")."""
    if backend == "ag_rs":
        return merge_partials_ag_rs(o_TNA, lse_TN, axes)
    if backend == "a2a":
        return merge_partials_a2a(o_TNA, lse_TN, axes)
    raise ValueError(f"unknown dcp comm backend {backend!r}")


def axis_size(axes: tuple[str, ...]) -> int:
    """Number of ranks over `axes` (static, inside shard_map)."""
    n = 1
    for a in axes:
        n *= lax.axis_size(a)
    return n


# ---------------------------------------------------------------------- gathers
def all_gather_tiled(x: jax.Array, axes: tuple[str, ...], axis: int = 0) -> jax.Array:
    """Concatenate every rank's `x` along `axis` (rank order = the axes' linear index)."""
    return lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x


def reduce_scatter_tiled(x: jax.Array, axes: tuple[str, ...], axis: int = 0) -> jax.Array:
    """Sum over ranks and keep this rank's slice along `axis` (the inverse of `all_gather_tiled`)."""
    return lax.psum_scatter(x, axes, scatter_dimension=axis, tiled=True) if axes else x


def psum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return lax.psum(x, axes) if axes else x


# ---------------------------------------------------------------------- global top-k
def topk_total_order(neg_score: jax.Array, pos: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k smallest (−score, position) pairs per row, lexicographically: higher score first, then
    lower position — the indexer's tie rule. Empty entries carry (+inf, INT32_MAX)."""
    ns, ps = lax.sort((neg_score, pos), dimension=-1, num_keys=2)
    return ns[..., :k], ps[..., :k]


def global_topk_merge(score_TK: jax.Array, pos_TK: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """Merge per-rank top-k lists into the global top-k with the total-order tie rule.

    Each rank holds the top-k of its own key shard (`pos` global positions, −1 = empty, `score` the
    indexer score). Because the order is total, every element of the global top-k is inside its
    own rank's top-k, so gathering the R lists and re-selecting gives exactly the single-device
    selection, ties at the boundary included.

    Returns (positions `[T, K]` int32 in rank order of the rule, −1 padding; valid count `[T]`).
    """
    k = pos_TK.shape[-1]
    valid = pos_TK >= 0
    neg = jnp.where(valid, -score_TK.astype(jnp.float32), jnp.inf)
    pos = jnp.where(valid, pos_TK, _BIG).astype(jnp.int32)
    if axes:
        neg = lax.all_gather(neg, axes, axis=1, tiled=True)  # [T, R*K]
        pos = lax.all_gather(pos, axes, axis=1, tiled=True)
    _, best = topk_total_order(neg, pos, k)
    ok = best != _BIG
    return jnp.where(ok, best, -1).astype(jnp.int32), jnp.sum(ok, axis=-1).astype(jnp.int32)
