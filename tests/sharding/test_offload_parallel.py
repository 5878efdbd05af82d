"""The offloading connector's host store under a parallel layout (serving/offload/transfer.py):
whole-page stores and loads round-trip byte-exactly on every KV shard (DCP rank), for both host
mechanisms ("memory_kind": a pinned_host array sharded like the arena; "callback": one numpy store
at per-shard row offsets, the GPU default), with the same block ids on every shard."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from serving.offload.transfer import OffloadTransfer
from sharding.mesh import ParallelConfig, ParallelLayout
from sharding.rules import arena_shards, cache_sharding


@pytest.mark.parametrize("mechanism", ["memory_kind", "callback"])
@pytest.mark.parametrize("config", [ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2),
                                    ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                                                   decode_context_parallel_size=2)], ids=["pcp2xdcp2", "tp2xpcp2xdcp2"])
def test_parallel_host_store_round_trips_every_shard(mechanism, config):
    par = ParallelLayout.create(config)
    nb, words, nhb = 12, 96, 9
    shards = arena_shards(par)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 2**32, (shards * nb, words), dtype=np.uint32)
    arena = jax.device_put(src, cache_sharding(par))
    t = OffloadTransfer(nhb, words, mechanism, max_ops=8, parallel=par)
    pairs = [(3, 1), (7, 2), (11, 5), (1, 8)]  # (device block, host block), the same on every shard
    t.store(arena, pairs)
    t.wait()
    empty = jax.device_put(np.zeros_like(src), cache_sharding(par))
    back = np.asarray(t.load(empty, [(h, b) for b, h in pairs]))
    for s in range(shards):
        for b, _ in pairs:
            assert np.array_equal(back[s * nb + b], src[s * nb + b]), (s, b)
        untouched = [b for b in range(nb) if b not in {p[0] for p in pairs}]
        assert not back[[s * nb + b for b in untouched]].any()
