"""Checks of a HiSparse engine's host pool shared by the engine tests: the pool as full rows, and
every clean host block against the device page it copies (one device, DCP ranks, DP replicas)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from glm53.attention import num_host_parts
from kernels.host_rows import page_to_rows, split_words


def replicas(engine) -> list:
    """(kv manager, HiSparse policy) per data-parallel replica."""
    kvs = [r.kv for r in engine.replicas] if hasattr(engine, "replicas") else [engine.kv]
    return list(zip(kvs, engine.hisparse.policies))


def host_rows_of(engine) -> np.ndarray:
    """The whole host pool as full rows `[shards · rows, L · W]` (column parts joined)."""
    dev = engine.hisparse.device
    _, comp = engine.layout.group("mla").component("mla")
    L, W = comp.num_layers, comp.row_words
    if dev.mechanism == "callback":
        return dev.pool.rows
    pool = np.asarray(dev.pool)
    par = engine.runner.parallel
    R = num_host_parts(par) if par is not None else 1
    wp = split_words(W, R)
    n = pool.shape[0]
    return pool.reshape(n, R, L, wp).transpose(0, 2, 1, 3).reshape(n, L, R * wp)[:, :, :W].reshape(n, L * W)


def check_host_pool_bytes(engine) -> int:
    """Every clean host block of every replica and DCP rank equals the device page it copies
    (that rank's share of the engine page; every layer of the `mla` group, the MTP layer's
    included). → the number of (block, rank) pairs checked."""
    dev, runner = engine.hisparse.device, engine.runner
    g = engine.layout.group("mla")
    tpp, nb = g.tokens_per_page, runner.num_blocks
    dcp = runner.parallel.dcp if runner.parallel is not None else 1
    arena = np.asarray(runner.kv_arena)
    pool = host_rows_of(engine)
    rows = dev.num_host_blocks * tpp
    assert pool.shape[0] == rows * len(replicas(engine)) * dcp
    checked = 0
    for rep, (kv, pol) in enumerate(replicas(engine)):
        for rid, rec in pol.records.items():
            t = kv.table(rid, "mla")
            for i, hb in rec.host_blocks.items():
                if i in rec.pending or not t.is_owned(i):
                    continue
                for d in range(dcp):
                    s = rep * dcp + d
                    want = np.asarray(page_to_rows(jnp.asarray(arena[s * nb + t.blocks[i]]), g, "mla"))
                    np.testing.assert_array_equal(pool[s * rows + hb * tpp: s * rows + (hb + 1) * tpp], want,
                                                  err_msg=f"replica {rep} rank {d} request {rid} page {i}")
                    checked += 1
    return checked
