"""Pallas indexer top-k (interpret mode) against the reference and dense numpy scores; dispatch rules.

Queries, keys and weights are small integers in most cases, so every dot product is exact in fp32
whatever the summation order: the Pallas and reference selections must then be identical, ties
included (the integers make many of them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.indexer_topk import api
from kernels.indexer_topk.pallas_triton import indexer_topk_pallas_triton
from kernels.indexer_topk.reference import indexer_topk_reference
from tests.kernels.conftest import make_layout, scatter_dense

I, DK = 4, 8
PALLAS = dict(t_chunk=4, s_chunk=32, block_s=16, interpret=True)  # 6 tokens → 2 query chunks (one padded)


def oracle(q, w, keys, pos, K):
    """Dense scores over keys 0..pos; order by (higher score, lower position); pad with −1."""
    s = np.einsum("id,sd->is", q.astype(np.float64), keys[: pos + 1].astype(np.float64))
    score = (w[:, None] * np.maximum(s, 0)).sum(0) * DK ** -0.5
    order = sorted(range(pos + 1), key=lambda j: (-score[j], j))[:K]
    return order + [-1] * (K - len(order))


def _ragged(rng, row_dtype, integer=True, lens=(10, 3, 40)):
    lay = make_layout(DK, num_layers=2, tpp=4, row_dtype=row_dtype)
    draw = (lambda *s: rng.integers(-3, 4, s).astype(np.float32)) if integer else \
        (lambda *s: rng.standard_normal(s).astype(np.float32))
    keys = [draw(n, DK) for n in lens]
    if row_dtype == "bfloat16":  # the oracle sees the stored values
        keys = [np.asarray(jnp.asarray(k).astype(jnp.bfloat16).astype(jnp.float32)) for k in keys]
    arena, bt, _ = scatter_dense(lay, 20, keys, 1, rng)
    req = np.array([0, 0, 1, 2, 2, 2], np.int32)
    pos = np.array([9, 4, 2, 39, 0, 21], np.int32)
    return lay, keys, arena, bt, req, pos, draw(6, I, DK), draw(6, I)


def _both(lay, arena, q, w, bt, req, pos, K, **kw):
    args = (jnp.asarray(q), jnp.asarray(w), arena, jnp.asarray(bt), jnp.asarray(req), jnp.asarray(pos), 1)
    ref = indexer_topk_reference(*args, layout=lay, component="c", topk=K)
    pal = indexer_topk_pallas_triton(*args, layout=lay, component="c", topk=K, **{**PALLAS, **kw})
    return [np.asarray(x) for x in ref], [np.asarray(x) for x in pal]


# For the 10-token request (pos 9): S = K + 1, S = K, S < K; both row dtypes.
@pytest.mark.parametrize("row_dtype,K", [("float32", 9), ("bfloat16", 10), ("float32", 11)])
def test_identical_to_reference_and_oracle(rng, row_dtype, K):
    lay, keys, arena, bt, req, pos, q, w = _ragged(rng, row_dtype)
    (ri, rv), (pi, pv) = _both(lay, arena, q, w, bt, req, pos, K)
    np.testing.assert_array_equal(pi, ri)
    np.testing.assert_array_equal(pv, rv)
    for t in range(6):  # independent: float64 numpy scores with the tie rule
        assert pi[t].tolist() == oracle(q[t], w[t], keys[req[t]], pos[t], K), t
        assert pv[t] == min(K, pos[t] + 1)


def test_random_real_valued_inputs(rng):
    """Non-integer data over several key chunks (40 keys, 32-position chunks)."""
    lay, keys, arena, bt, req, pos, q, w = _ragged(rng, "float32", integer=False)
    (ri, rv), (pi, pv) = _both(lay, arena, q, w, bt, req, pos, 7)
    np.testing.assert_array_equal(pi, ri)
    np.testing.assert_array_equal(pv, rv)


def test_ties_and_null_blocks(rng):
    """Exact-zero ReLU scores tie and resolve to the lower position; keys in pages mapped to the
    null block (released / placeholder) are never selected."""
    lay = make_layout(DK, num_layers=2, tpp=4)
    keys = np.zeros((12, DK), np.float32)
    keys[[2, 7], 0] = 1.0  # the only positive scores
    keys[[3, 5], 1] = -1.0  # negative dots: ReLU 0, tied with the zero keys
    keys[9, 0] = 5.0
    arena, bt, _ = scatter_dense(lay, 8, [keys], 1, rng)
    bt = bt.copy()
    bt[0, 2] = 0  # positions 8..11 (key 9, the best) live in the null block
    q = np.zeros((1, I, DK), np.float32)
    q[0, :, :2] = 1.0
    w = np.ones((1, I), np.float32)
    (ri, rv), (pi, pv) = _both(lay, arena, q, w, bt, np.zeros(1, np.int32), np.array([11], np.int32), 9)
    assert pi[0].tolist() == [2, 7, 0, 1, 3, 4, 5, 6, -1] and pv[0] == 8
    np.testing.assert_array_equal(pi, ri)


def test_dispatch(rng):
    lay, _, arena, bt, req, pos, q, w = _ragged(rng, "float32")
    args = (jnp.asarray(q), jnp.asarray(w), arena, jnp.asarray(bt), jnp.asarray(req), jnp.asarray(pos), 1)
    kw = dict(layout=lay, component="c", topk=6)
    assert api.default_implementation() == ("pallas_triton" if jax.default_backend() == "gpu" else "xla")
    ref = indexer_topk_reference(*args, **kw)
    for got in (api.indexer_topk(*args, **kw), api.indexer_topk(*args, **kw, interpret=True)):
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Three indexer heads (not a power of two): refused explicitly, reference by default.
    args3 = (args[0][:, :3], args[1][:, :3], *args[2:])
    with pytest.raises(NotImplementedError, match="heads"):
        api.indexer_topk(*args3, **kw, implementation="pallas_triton", interpret=True)
    for a, b in zip(api.indexer_topk(*args3, **kw, interpret=True), indexer_topk_reference(*args3, **kw)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
