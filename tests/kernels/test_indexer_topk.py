"""Indexer top-k reference against dense numpy scores with the documented tie rule."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.indexer_topk.reference import indexer_topk_reference
from tests.kernels.conftest import make_layout, scatter_dense

I, DK = 3, 8


def oracle(q, w, keys, pos, K):
    """Dense scores over keys 0..pos; order by (higher score, lower position); pad with −1."""
    s = np.einsum("id,sd->is", q.astype(np.float64), keys[: pos + 1].astype(np.float64))
    score = (w[:, None] * np.maximum(s, 0)).sum(0) * DK ** -0.5
    order = sorted(range(pos + 1), key=lambda j: (-score[j], j))[:K]
    return order + [-1] * (K - len(order)), score


def run(arena, lay, q, w, bt, req, pos, K, **kw):
    idx, valid = indexer_topk_reference(jnp.asarray(q), jnp.asarray(w), arena, jnp.asarray(bt), jnp.asarray(req),
                                        jnp.asarray(pos), 0, layout=lay, component="c", topk=K, **kw)
    return np.asarray(idx), np.asarray(valid)


@pytest.mark.parametrize("K", [5, 9, 10, 11])  # S < K, S = K, S = K + 1 around a 10-token request
def test_matches_dense_ragged_batch(rng, K):
    lay = make_layout(DK, num_layers=1, tpp=4)
    lens = (10, 3, 17)
    keys = [rng.standard_normal((n, DK)).astype(np.float32) for n in lens]
    arena, bt, _ = scatter_dense(lay, 16, keys, 0, rng)
    req = np.array([0, 0, 1, 2, 2, 2], np.int32)
    pos = np.array([9, 4, 2, 16, 0, 10], np.int32)
    q = rng.standard_normal((6, I, DK)).astype(np.float32)
    w = rng.standard_normal((6, I)).astype(np.float32)
    idx, valid = run(arena, lay, q, w, bt, req, pos, K, t_chunk=4, s_chunk=4)
    for t in range(6):
        want, _ = oracle(q[t], w[t], keys[req[t]], pos[t], K)
        assert idx[t].tolist() == want, t
        assert valid[t] == min(K, pos[t] + 1)


def test_ties_break_to_lower_position(rng):
    """Keys orthogonal to every query give exact-zero ReLU scores: ties resolved by position."""
    lay = make_layout(DK, num_layers=1, tpp=4)
    keys = np.zeros((12, DK), np.float32)
    keys[[2, 7], 0] = 1.0  # the only positive scores
    keys[[3, 5], 1] = -1.0  # negative dot -> ReLU 0, same as zero keys
    arena, bt, _ = scatter_dense(lay, 8, [keys], 0, rng)
    q = np.zeros((1, I, DK), np.float32)
    q[0, :, 0] = 1.0
    q[0, :, 1] = 1.0
    w = np.ones((1, I), np.float32)
    idx, _ = run(arena, lay, q, w, bt, np.zeros(1, np.int32), np.array([11], np.int32), 5, s_chunk=4)
    assert idx[0].tolist() == [2, 7, 0, 1, 3]


def test_chunking_does_not_change_the_selection(rng):
    lay = make_layout(DK, num_layers=1, tpp=4)
    keys = rng.standard_normal((30, DK)).astype(np.float32)
    keys[::3] = 0.0  # plenty of ties at zero
    arena, bt, _ = scatter_dense(lay, 12, [keys], 0, rng)
    q = rng.standard_normal((5, I, DK)).astype(np.float32)
    w = np.abs(rng.standard_normal((5, I))).astype(np.float32)
    args = (arena, lay, q, w, bt, np.zeros(5, np.int32), np.array([29, 20, 7, 15, 28], np.int32), 8)
    a, _ = run(*args, t_chunk=1, s_chunk=4)
    b, _ = run(*args, t_chunk=5, s_chunk=64)
    np.testing.assert_array_equal(a, b)
    for t in range(5):
        assert a[t].tolist() == oracle(q[t], w[t], keys, int(args[6][t]), 8)[0]


def test_null_block_pages_are_not_selected(rng):
    lay = make_layout(DK, num_layers=1, tpp=4)
    keys = np.abs(rng.standard_normal((8, DK))).astype(np.float32)
    arena, bt, _ = scatter_dense(lay, 8, [keys], 0, rng)
    bt = bt.copy()
    bt[0, 0] = 0  # positions 0..3 now live in the null block (released / placeholder)
    q = np.abs(rng.standard_normal((1, I, DK))).astype(np.float32)
    idx, valid = run(arena, lay, q, np.ones((1, I), np.float32), bt, np.zeros(1, np.int32), np.array([7]), 8)
    assert sorted(i for i in idx[0] if i >= 0) == [4, 5, 6, 7] and valid[0] == 4


def test_padding_rows_beside_one_request(rng):
    """A prefill chunk of one request padded with rows of the all-null padding row (as the step
    pads its tokens): the request's rows match the dense oracle and the padding rows select
    nothing, as without the padding (the padding must not change which path computes the scores
    or what they are)."""
    lay = make_layout(DK, num_layers=1, tpp=4)
    keys = rng.standard_normal((21, DK)).astype(np.float32)
    arena, bt, _ = scatter_dense(lay, 12, [keys], 0, rng)
    bt = np.concatenate([bt, np.zeros_like(bt)])  # row 1: the padding row (every page null)
    q = rng.standard_normal((6, I, DK)).astype(np.float32)
    w = rng.standard_normal((6, I)).astype(np.float32)
    pos = np.array([17, 18, 19, 20, 0, 0], np.int32)
    req = np.array([0, 0, 0, 0, 1, 1], np.int32)
    idx, valid = run(arena, lay, q, w, bt, req, pos, 6, s_chunk=8)
    alone, _ = run(arena, lay, q[:4], w[:4], bt, req[:4], pos[:4], 6, s_chunk=8)
    for t in range(4):
        assert idx[t].tolist() == oracle(q[t], w[t], keys, int(pos[t]), 6)[0], t
    np.testing.assert_array_equal(idx[:4], alone)
    assert (idx[4:] == -1).all() and (valid[4:] == 0).all()
