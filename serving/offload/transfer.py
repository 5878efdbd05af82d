"""The device side of the offloading connector: the host page store array and its two programs.

`OffloadTransfer.host` is `uint32[num_host_blocks, page_words]`: a `pinned_host` `jax.Array`
("memory_kind") or a numpy `HostRowStore` ("callback"), chosen like HiSparse's
(`kernels.host_rows.default_mechanism`). `store` (host ← arena pages) and `load` (arena ← host
pages) are jitted programs of their own, dispatched by the model runner before the step, stores
first (`kernels.host_rows.store_arena_pages` / `load_arena_pages`). Their index lists are −1
padded to a power of two (at most `max_ops`), so each program compiles for a few shapes only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels.host_rows import load_arena_pages, store_arena_pages
from serving.hisparse.device_state import make_host_pool


def _bucket(n: int, cap: int) -> int:
    b = 8
    while b < n:
        b *= 2
    return min(b, max(cap, 8))


class OffloadTransfer:
    """Host page store + store/load programs.

    Args:
      num_host_blocks: host blocks including the null block. page_words: uint32 words per page.
      mechanism: "memory_kind" or "callback". max_ops: most pages one program moves (longer
        lists are split over several calls).
      parallel: the engine's `ParallelLayout` (None: one device). Under DCP every KV shard (DCP
        rank) stores its share of each page: the store is `[shards · num_host_blocks, page_words]`,
        sharded like the arena's rows (memory_kind: each shard's rows on its devices, replicated
        over the devices holding the same KV; callback: one numpy store, shard s at rows
        `s · num_host_blocks …`), and the programs run per shard (`shard_map`). Under data
        parallelism the KV shards are replica-major (replica r's DCP ranks), every replica
        numbering its own host blocks (its own `OffloadStore`), and each program takes one index
        list per replica (`[dp, n]`, split over the replicas): every shard of replica r moves
        replica r's pages.

    `store` and `load` take one list of pairs per replica (`per_replica`; one list on one device
    or without data parallelism).
    """

    def __init__(self, num_host_blocks: int, page_words: int, mechanism: str, max_ops: int = 1024, parallel=None):
        # host index lists → device arrays (a multi-process engine replaces it with a replicated
        # global placement: `serving.runner.ModelRunner`)
        self.put = jnp.asarray
        self.num_replicas = 1
        self._parallel = False  # index lists [replicas, n] (a parallel layout) rather than [n]
        self.mechanism = mechanism
        self.max_ops = int(max_ops)
        self.page_words = int(page_words)
        self._done = None
        if parallel is not None and not parallel.is_single_device:
            self._build_parallel(num_host_blocks, page_words, mechanism, parallel)
            return
        self.host = make_host_pool(mechanism, num_host_blocks, page_words)

        @functools.partial(jax.jit, donate_argnums=(0,) if mechanism == "memory_kind" else ())
        def store(host, arena, src, dst):
            return store_arena_pages(host, arena, src, dst, mechanism=mechanism)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def load(arena, host, src, dst):
            return load_arena_pages(arena, host, src, dst, mechanism=mechanism)

        self._store, self._load = store, load

    def _build_parallel(self, nhb: int, page_words: int, mechanism: str, par) -> None:
        from jax.sharding import NamedSharding, PartitionSpec

        from glm53.attention import kv_shard_axes
        from kernels.host_rows import HostRowStore
        from sharding.mesh import KV_REPLICA
        from sharding.rules import cache_sharding

        self.num_replicas = par.dp
        self._parallel = True
        arena_spec = cache_sharding(par).spec
        axes = kv_shard_axes(par)
        shards = 1
        for a in axes:
            shards *= par.mesh.shape[a]
        shape = (shards * nhb, page_words)
        if mechanism == "callback":
            self.host = HostRowStore(*shape)
        else:
            sharding = NamedSharding(par.mesh, arena_spec, memory_kind="pinned_host")
            local = sharding.shard_shape(shape)
            self.host = jax.make_array_from_callback(shape, sharding, lambda _: np.zeros(local, np.uint32))
        rep = PartitionSpec()
        lists = par.spec(KV_REPLICA, None)  # [dp, n]: replica r's list on replica r's devices

        def offset():
            return jax.lax.axis_index(axes) * nhb if axes else 0

        if mechanism == "callback":
            store_host = self.host

            def store_body(arena, src, dst):
                return store_arena_pages(store_host, arena, src[0], dst[0], mechanism=mechanism,
                                         row_offset=offset())[1]

            def load_body(arena, src, dst):
                return load_arena_pages(arena, store_host, src[0], dst[0], mechanism=mechanism, row_offset=offset())

            store_sm = jax.shard_map(store_body, mesh=par.mesh, in_specs=(arena_spec, lists, lists), out_specs=rep,
                                     check_vma=False)
            load_sm = jax.shard_map(load_body, mesh=par.mesh, in_specs=(arena_spec, lists, lists),
                                    out_specs=arena_spec, check_vma=False)
            self._store = jax.jit(lambda host, arena, src, dst: (host, store_sm(arena, src, dst)))
            self._load = jax.jit(lambda arena, host, src, dst: load_sm(arena, src, dst), donate_argnums=(0,))
            return

        def store_body(host, arena, src, dst):
            return store_arena_pages(host, arena, src[0], dst[0], mechanism=mechanism)

        def load_body(arena, host, src, dst):
            return load_arena_pages(arena, host, src[0], dst[0], mechanism=mechanism)

        self._store = jax.jit(jax.shard_map(store_body, mesh=par.mesh,
                                            in_specs=(arena_spec, arena_spec, lists, lists),
                                            out_specs=(arena_spec, rep), check_vma=False), donate_argnums=(0,))
        self._load = jax.jit(jax.shard_map(load_body, mesh=par.mesh, in_specs=(arena_spec, arena_spec, lists, lists),
                                           out_specs=arena_spec, check_vma=False), donate_argnums=(0,))

    def _lists(self, per_replica):
        """int32 index lists for `per_replica` (one list of pairs per replica), −1 padded to a
        power of two, at most `max_ops` a call: `[n]` on one device, `[replicas, n]` under a
        parallel layout."""
        if len(per_replica) != self.num_replicas:
            raise ValueError(f"{len(per_replica)} transfer lists for {self.num_replicas} replicas")
        longest = max(len(p) for p in per_replica)
        for i in range(0, longest, self.max_ops):
            chunks = [p[i:i + self.max_ops] for p in per_replica]
            n = _bucket(max(len(c) for c in chunks), self.max_ops)
            src = np.full((len(chunks), n), -1, np.int32)
            dst = np.full((len(chunks), n), -1, np.int32)
            for r, chunk in enumerate(chunks):
                if chunk:
                    src[r, :len(chunk)], dst[r, :len(chunk)] = np.asarray(chunk, np.int32).T
            if not self._parallel:
                src, dst = src[0], dst[0]
            yield self.put(src), self.put(dst)

    def store(self, arena: jax.Array, per_replica) -> None:
        """Host block ← arena page for each `(device_block, host_block)` of each replica's list
        (`per_replica[r]`: replica r's pages and host blocks). Raises ValueError when there is not
        one list per replica."""
        for src, dst in self._lists(per_replica):
            self.host, self._done = self._store(self.host, arena, src, dst)

    def load(self, arena: jax.Array, per_replica) -> jax.Array:
        """Arena page ← host block for each `(host_block, device_block)` of each replica's list;
        returns the arena (the input is donated). Raises ValueError as `store`."""
        for src, dst in self._lists(per_replica):
            arena = self._load(arena, self.host, src, dst)
        return arena

    def wait(self) -> None:
        """Block until the dispatched stores ran (an idle engine flushing its queue)."""
        if self._done is not None:
            jax.block_until_ready(self._done)
