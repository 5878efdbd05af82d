"""Sparse MLA reference against plain numpy softmax attention over the selected rows."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.sparse_mla.reference import sparse_mla_reference
from tests.kernels.conftest import make_layout, scatter_dense

A, R, N = 8, 4, 3


def dense_oracle(q, kv_rows, valid, scale):
    """q [N, C], kv_rows [K, C], valid [K] → (o [N, A], lse [N]) in float64."""
    if not valid.any():
        return np.zeros((q.shape[0], A)), np.full(q.shape[0], -np.inf)
    rows = kv_rows[valid].astype(np.float64)
    s = q.astype(np.float64) @ rows.T * scale
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return (e / e.sum(-1, keepdims=True)) @ rows[:, :A], (m[:, 0] + np.log(e.sum(-1)))


@pytest.mark.parametrize("row_dtype", ["float32", "bfloat16"])
def test_matches_dense_over_ragged_requests_with_minus_one_and_null(rng, row_dtype):
    lay = make_layout(A + R, num_layers=2, tpp=4, row_dtype=row_dtype)
    seqs = [rng.standard_normal((n, A + R)).astype(np.float32) for n in (3, 9, 13)]
    arena, bt, slots = scatter_dense(lay, 12, seqs, 1, rng)
    T, K = 7, 6
    req = np.array([0, 1, 1, 2, 2, 2, 2])
    topk = np.full((T, K), -1, np.int32)
    for t in range(T):
        n = len(seqs[req[t]])
        pick = rng.choice(n, size=min(K - 1, n), replace=False)
        topk[t, : len(pick)] = slots[req[t]][pick]
    topk[5, :] = -1  # an empty row
    topk[6, 0] = 2  # a slot inside the null block counts as absent
    q = rng.standard_normal((T, N, A + R)).astype(np.float32)
    o, lse = sparse_mla_reference(jnp.asarray(q), arena, jnp.asarray(topk), 1, layout=lay, component="c", kv_lora_rank=A,
                                  scale=0.3, t_chunk=3)
    o, lse = np.asarray(o), np.asarray(lse)
    tol = 1e-5 if row_dtype == "float32" else 1e-5  # rows are stored rounded; compare against stored rows
    for t in range(T):
        s = seqs[req[t]]
        if row_dtype == "bfloat16":
            s = np.asarray(jnp.asarray(s).astype(jnp.bfloat16).astype(jnp.float32))
        slot_to_row = {int(sl): i for i, sl in enumerate(slots[req[t]])}
        valid = np.array([int(x) in slot_to_row for x in topk[t]])
        rows = np.stack([s[slot_to_row[int(x)]] if v else np.zeros(A + R) for x, v in zip(topk[t], valid)])
        o_ref, lse_ref = dense_oracle(q[t], rows, valid, 0.3)
        np.testing.assert_allclose(o[t], o_ref, atol=tol, rtol=tol)
        np.testing.assert_allclose(lse[t], lse_ref, atol=tol, rtol=tol)
    assert np.all(np.isneginf(lse[5])) and np.all(o[5] == 0) and not np.isnan(o).any()


def test_all_keys_selected_equals_dense_causal_attention(rng):
    lay = make_layout(A + R, num_layers=1, tpp=4)
    S = 10
    kv = rng.standard_normal((S, A + R)).astype(np.float32)
    arena, bt, slots = scatter_dense(lay, 6, [kv], 0, rng)
    q = rng.standard_normal((S, N, A + R)).astype(np.float32)
    topk = np.array([[slots[0][s] if s <= t else -1 for s in range(S)] for t in range(S)], np.int32)
    o, _ = sparse_mla_reference(jnp.asarray(q), arena, jnp.asarray(topk), 0, layout=lay, component="c", kv_lora_rank=A, scale=0.5)
    s = np.einsum("tnc,sc->tns", q.astype(np.float64), kv) * 0.5
    s = np.where(np.tril(np.ones((S, S), bool))[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(o), p @ kv[:, :A], atol=1e-5)


def test_result_depends_only_on_selected_rows_not_their_location(rng):
    """The same rows at different slots (e.g. a hot buffer) give bit-identical output."""
    lay = make_layout(A + R, num_layers=1, tpp=4)
    kv = rng.standard_normal((8, A + R)).astype(np.float32)
    arena1, _, s1 = scatter_dense(lay, 8, [kv], 0, np.random.default_rng(1))
    arena2, _, s2 = scatter_dense(lay, 8, [kv], 0, np.random.default_rng(2))
    assert not np.array_equal(s1[0], s2[0])
    q = jnp.asarray(rng.standard_normal((2, N, A + R)).astype(np.float32))
    pick = np.array([[5, 1, 7, -1], [0, 2, 3, 6]])
    t1 = np.where(pick >= 0, s1[0][pick], -1).astype(np.int32)
    t2 = np.where(pick >= 0, s2[0][pick], -1).astype(np.int32)
    o1, l1 = sparse_mla_reference(q, arena1, jnp.asarray(t1), 0, layout=lay, component="c", kv_lora_rank=A, scale=0.2)
    o2, l2 = sparse_mla_reference(q, arena2, jnp.asarray(t2), 0, layout=lay, component="c", kv_lora_rank=A, scale=0.2)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
