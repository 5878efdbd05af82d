"""Ties at the indexer's top-k boundary across DCP ranks select what one device selects.

Keys are multiples of one unit vector and queries/weights small integers, so every score is
exact in fp32 and most are tied (five distinct values over 200 keys, K = 16): the boundary of
almost every query row falls inside a run of equal scores spread round-robin over the ranks.
Oracle: numpy sorting by (−score, position) — the total-order rule of docs/design.md §3.3 — and the
single-device path. Covers the DCP-over-TP merge (per-rank top-k + `global_topk_merge`) and the
DCP-over-PCP temporary full copy and DCP over TP × PCP (both), written through the parallel
cache-write path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm53 import attention
from glm53.kv_layout import KVCacheLayout
from glm53.parallel_batch import empty_parallel_arena, replica_batch, shard_batch, stack_replicas
from kernels.paged import CacheComponent, GroupLayout
from sharding.mesh import TOKENS, ParallelConfig, ParallelLayout

S, DK, HEADS, K = 200, 32, 2, 16
LAYOUT = KVCacheLayout(64 * DK, (GroupLayout("indexer", 64, (CacheComponent("indexer", 1, DK, "float32"),)),))


def _inputs():
    rng = np.random.default_rng(3)
    c = rng.integers(-1, 4, S).astype(np.float32)  # key multiplier per position
    keys = np.zeros((S, DK), np.float32)
    keys[:, 5] = c
    q = np.zeros((S, HEADS, DK), np.float32)
    q[:, 0, 5], q[:, 1, 5] = 2.0, -1.0
    w = np.tile(np.array([1.0, 3.0], np.float32), (S, 1))
    score = np.maximum(2 * c, 0) + 3 * np.maximum(-c, 0)  # exact; the common DK^-0.5 factor keeps order
    expect = np.full((S, K), -1, np.int32)
    for t in range(S):
        order = sorted(range(t + 1), key=lambda s: (-score[s], s))[:K]
        expect[t, :len(order)] = order
    return keys, q, w, expect


def _select(par, keys, q, w):
    dcp = par.dcp if par is not None else 1
    n = -(-S // (64 * dcp))
    blocks = {"indexer": list(range(1, 1 + n))}
    b = replica_batch(LAYOUT, [(np.zeros(S, np.int32), 0, blocks)], S, 2, dcp)

    def f(arena, keys, q, w, batch):
        arena = attention.write_kv(arena, keys, batch, LAYOUT, "indexer", "indexer", 0, parallel=par)
        return attention.select_topk(q, w, arena, batch, LAYOUT, "indexer", 0, K, parallel=par)

    if par is None:
        return np.asarray(jax.jit(f)(LAYOUT.empty_arena(1 + n), keys, q, w, jax.tree.map(jnp.asarray, b)))
    put = lambda x, *roles: jax.device_put(x, par.sharding(*roles))  # noqa: E731
    out = jax.jit(f)(empty_parallel_arena(LAYOUT, 1 + n, par), put(keys, TOKENS, None), put(q, TOKENS, None, None),
                     put(w, TOKENS, None), shard_batch(stack_replicas([b], 1), par))
    return np.asarray(out)


@pytest.fixture(scope="module")
def case():
    keys, q, w, expect = _inputs()
    single = _select(None, keys, q, w)
    np.testing.assert_array_equal(single, expect)  # the oracle and the reference kernel agree
    return keys, q, w, expect


@pytest.mark.parametrize("cfg", [
    ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=4),
    ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8, dcp_kv_cache_interleave_size=4),
    ParallelConfig(prefill_context_parallel_size=4, decode_context_parallel_size=4),
    ParallelConfig(prefill_context_parallel_size=2, tensor_parallel_size=4, decode_context_parallel_size=8),
], ids=["dcp4_tp", "dcp8_tp_i4", "dcp4_pcp", "dcp8_pcp2_tp4"])
def test_ties_across_dcp_ranks(case, cfg):
    keys, q, w, expect = case
    par = ParallelLayout.create(cfg)
    got = _select(par, keys, q, w)
    # Guard: the boundary really falls inside ties that span ranks.
    c = keys[:, 5]
    score = np.maximum(2 * c, 0) + 3 * np.maximum(-c, 0)
    boundary = score[expect[-1, K - 1]]
    tied = np.flatnonzero(score == boundary)
    assert len({(p // cfg.dcp_kv_cache_interleave_size) % par.dcp for p in tied}) == par.dcp
    assert np.sum(score > boundary) < K < np.sum(score >= boundary)
    np.testing.assert_array_equal(got, expect)
