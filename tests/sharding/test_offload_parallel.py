"""The offloading connector's host store under a parallel layout (serving/offload/transfer.py):
whole-page stores and loads round-trip byte-exactly on every KV shard (DCP rank, data-parallel
replica), for both host mechanisms ("memory_kind": a pinned_host array sharded like the arena;
"callback": one numpy store at per-shard row offsets, the GPU default). Every DCP rank of a replica
moves the same block ids; under data parallelism each replica moves its own list (replica 1's
pages are not replica 0's), and a replica with an empty list moves nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from serving.offload.transfer import OffloadTransfer
from sharding.mesh import ParallelConfig, ParallelLayout
from sharding.rules import arena_shards, cache_sharding

# (device block, host block) per replica (one replica without data parallelism).
PAIRS = [(3, 1), (7, 2), (11, 5), (1, 8)]
REPLICA_PAIRS = {1: [PAIRS], 2: [PAIRS, [(2, 1), (9, 3), (5, 4)]]}


@pytest.mark.parametrize("mechanism", ["memory_kind", "callback"])
@pytest.mark.parametrize("config", [ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2),
                                    ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                                                   decode_context_parallel_size=2),
                                    ParallelConfig(data_parallel_size=2, tensor_parallel_size=2,
                                                   decode_context_parallel_size=2)],
                         ids=["pcp2xdcp2", "tp2xpcp2xdcp2", "dp2xtp2xdcp2"])
def test_parallel_host_store_round_trips_every_shard(mechanism, config):
    par = ParallelLayout.create(config)
    nb, words, nhb = 12, 96, 9
    shards = arena_shards(par)
    per_replica = shards // par.dp
    rng = np.random.default_rng(0)
    src = rng.integers(0, 2**32, (shards * nb, words), dtype=np.uint32)
    arena = jax.device_put(src, cache_sharding(par))
    t = OffloadTransfer(nhb, words, mechanism, max_ops=8, parallel=par)
    pairs = REPLICA_PAIRS[par.dp]
    with pytest.raises(ValueError, match="transfer lists for"):
        t.store(arena, pairs + [[]])
    t.store(arena, pairs)
    t.wait()
    empty = jax.device_put(np.zeros_like(src), cache_sharding(par))
    # Replica 1 of the DP layout loads its own host blocks back into other pages than it stored from.
    loads = [[(h, b) for b, h in pairs[0]]] + [[(h, (b + 1) % nb or 1) for b, h in p] for p in pairs[1:]]
    back = np.asarray(t.load(empty, loads))
    for s in range(shards):
        r = s // per_replica
        moved = {}
        for (b, _), (_, d) in zip(pairs[r], loads[r]):
            moved[d] = b
            assert np.array_equal(back[s * nb + d], src[s * nb + b]), (s, b, d)
        untouched = [b for b in range(nb) if b not in moved]
        assert not back[[s * nb + b for b in untouched]].any()
    if par.dp > 1:  # replica 1 with an empty list: its shards are left alone
        empty = jax.device_put(np.zeros_like(src), cache_sharding(par))
        back = np.asarray(t.load(empty, [loads[0], []]))
        assert not back[per_replica * nb:].any() and back[:per_replica * nb].any()
