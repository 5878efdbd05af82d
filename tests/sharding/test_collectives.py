"""Collective building blocks against dense numpy maths (4 simulated devices).

Split-softmax merge: attention over a key set split into R disjoint shards, each shard's
`(o, lse)` merged, equals one softmax over all keys (numpy, float64). Shards with no valid key
(lse = −inf, o filled with NaN to prove it is never read) must get weight 0; a row with no valid
key anywhere must give o = 0, lse = −inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sharding import collectives as col
from sharding.context_parallel import (dcp_causal_limit, dcp_global_positions, dcp_local_positions,
                                       dcp_local_slots, pcp_chunk_order)
from sharding.mesh import ParallelConfig, ParallelLayout

R, T, N, A, KEYS = 4, 3, 8, 5, 12


def _partials():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((T, N, KEYS))
    v = rng.standard_normal((KEYS, A))
    shard = np.arange(KEYS) % R
    valid = np.ones((T, KEYS), bool)
    valid[1, shard == 2] = False  # row 1: rank 2 has no valid key
    valid[2] = False  # row 2: nothing valid at all
    o = np.full((R, T, N, A), np.nan, np.float32)
    lse = np.full((R, T, N), -np.inf, np.float32)
    for r in range(R):
        for t in range(T):
            m = valid[t] & (shard == r)
            if m.any():
                e = np.exp(s[t][:, m])
                o[r, t] = (e / e.sum(-1, keepdims=True)) @ v[m]
                lse[r, t] = np.log(e.sum(-1))
    dense_o = np.zeros((T, N, A))
    dense_lse = np.full((T, N), -np.inf)
    for t in range(T):
        if valid[t].any():
            e = np.exp(s[t][:, valid[t]])
            dense_o[t] = (e / e.sum(-1, keepdims=True)) @ v[valid[t]]
            dense_lse[t] = np.log(e.sum(-1))
    return o, lse, dense_o, dense_lse


def test_lse_merge_matches_dense_softmax():
    o, lse, dense_o, dense_lse = _partials()
    mo, ml = col.lse_merge(jnp.asarray(o), jnp.asarray(lse))
    assert np.isfinite(np.asarray(mo)).all()
    np.testing.assert_allclose(np.asarray(mo), dense_o, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ml), dense_lse, atol=1e-5)
    assert np.all(np.asarray(ml)[2] == -np.inf) and np.all(np.asarray(mo)[2] == 0)


@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_dcp_merge_backends(backend):
    o, lse, dense_o, dense_lse = _partials()
    par = ParallelLayout.create(ParallelConfig(tensor_parallel_size=R, decode_context_parallel_size=R))

    def body(o_r, lse_r):  # each rank: its partial for all heads → merged for its heads
        mo, ml = col.merge_partials(o_r[0], lse_r[0], ("tp",), backend)
        return mo[None], ml[None]

    f = jax.shard_map(body, mesh=par.mesh, in_specs=(P("tp"), P("tp")), out_specs=(P("tp"), P("tp")),
                      check_vma=False)
    mo, ml = f(jnp.asarray(o), jnp.asarray(lse))  # [R, T, N/R, A]: rank r holds heads r·N/R ..
    mo = np.concatenate(list(np.asarray(mo)), axis=1)
    ml = np.concatenate(list(np.asarray(ml)), axis=1)
    assert np.isfinite(mo).all()
    np.testing.assert_allclose(mo, dense_o, atol=1e-5)
    np.testing.assert_allclose(ml, dense_lse, atol=1e-5)


def test_dcp_index_maths_round_robin():
    """Position p lives on rank (p // I) % N; local positions are dense and increasing per rank."""
    n, inter, g = 4, 2, 8
    p = np.arange(3 * g * n)
    for r in range(n):
        owned = p[(p // inter) % n == r]
        loc = dcp_local_positions(p, r, n, inter, g)
        assert np.array_equal(loc[owned], np.arange(len(owned)))
        assert np.all(loc[(p // inter) % n != r] == -1)
        assert np.array_equal(dcp_global_positions(np.arange(len(owned)), r, n, inter, g), owned)
        # causal bound: number of owned positions <= x, minus one
        lim = dcp_causal_limit(p, r, n, inter, g)
        assert np.array_equal(lim, np.array([np.sum(owned <= x) - 1 for x in p]))
    # engine slot (pages of g·n tokens) → local slot in the same block id
    blocks = np.array([5, 2, 7])
    slots = blocks[p // (g * n)] * g * n + p % (g * n)
    for r in range(n):
        owned = (p // inter) % n == r
        loc = dcp_local_slots(slots, r, n, inter, g)
        lp = dcp_local_positions(p, r, n, inter, g)
        assert np.array_equal(loc[owned], blocks[lp[owned] // g] * g + lp[owned] % g)
        assert np.all(loc[~owned] == -1)


def test_pcp_chunk_order_balances_pairs():
    order = pcp_chunk_order(16, 2)  # 4 chunks of 4: rank 0 gets chunks 0 and 3, rank 1 chunks 1 and 2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="multiple of 2"):
        pcp_chunk_order(10, 4)
