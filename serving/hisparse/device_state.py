"""The device side of HiSparse that the model runner threads through its jitted step.

`HiSparseDeviceState` owns, between steps:

* the host pool array `uint32[num_host_blocks · tpp, L · W]` (token-major host rows of every
  sparse-MLA layer, `kernels/host_rows`): a `pinned_host` `jax.Array` for the "memory_kind"
  mechanism (donated to every step), or a numpy `HostRowStore` for "callback";
* the per-request hot state `HotState [max_num_seqs, index groups, max_hot_rows]` (donated).

and builds the per-step inputs from the policy: the `HotBatch` (host tables, leases, state rows,
stale-slot marks) and the write-through copies (device page → host block, −1 padded to a fixed
length so the store program never recompiles; the runner dispatches them before the step). The
step returns the state updated and its lookup counters `[hits, misses, dropped, layer rows
copied]`.
"""

from __future__ import annotations

import logging
import math

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from glm53.hot_cache import HotBatch, HotState
from kernels.host_rows import HostRowStore

from serving.hisparse.config import ResolvedHiSparse

logger = logging.getLogger(__name__)


def make_parallel_host_pool(mechanism: str, rows_per_shard: int, num_layers: int, row_words: int, parallel):
    """The host pool of a parallel layout: "memory_kind" — a `pinned_host` `jax.Array`
    `uint32[shards · rows_per_shard, parts · L · Wp]` sharded by `glm53.attention.host_pool_spec`
    (each KV shard's rows on its devices, the columns split over the devices that hold the same
    KV: one host copy per shard), allocated shard by shard on the host; "callback" — one numpy
    `HostRowStore` `[shards · rows_per_shard, L · W]` that every device reads (one copy)."""
    from jax.sharding import NamedSharding

    from glm53.attention import host_pool_spec, num_host_parts, num_kv_shards
    from kernels.host_rows import split_words

    shards = num_kv_shards(parallel)
    if mechanism == "callback":
        return HostRowStore(shards * rows_per_shard, num_layers * row_words)
    parts = num_host_parts(parallel)
    shape = (shards * rows_per_shard, parts * num_layers * split_words(row_words, parts))
    sharding = NamedSharding(parallel.mesh, host_pool_spec(parallel), memory_kind="pinned_host")
    local = sharding.shard_shape(shape)
    pool = jax.make_array_from_callback(shape, sharding, lambda _: np.zeros(local, np.uint32))
    if jax.typeof(pool).memory_space != jax.memory.Space.Host:
        raise RuntimeError(f"the host pool is typed {jax.typeof(pool)}, not host memory")
    return pool


def make_host_pool(mechanism: str, num_rows: int, row_words: int, device=None):
    """A zeroed host pool: a `pinned_host` `jax.Array` ("memory_kind") or a `HostRowStore`
    ("callback").

    The pinned array is made by `device_put` of host zeros, never through device memory (a pool
    may be far larger than the device). (A jit output with a `pinned_host` out_sharding would not
    do: jax 0.11 types it as device memory, and the step's host-memory ops then refuse it.)"""
    if mechanism == "callback":
        return HostRowStore(num_rows, row_words)
    device = device or jax.devices()[0]
    sharding = SingleDeviceSharding(device, memory_kind="pinned_host")
    pool = jax.device_put(np.zeros((num_rows, row_words), np.uint32), sharding)
    if jax.typeof(pool).memory_space != jax.memory.Space.Host:
        raise RuntimeError(f"the host pool is typed {jax.typeof(pool)}, not host memory")
    return pool


class HiSparseDeviceState:
    """See the module docstring.

    Args:
      config: the resolved HiSparse settings (mechanism, hot rows).
      mla_layout: the MLA group's `GroupLayout` (tokens per page on one device, layers, row words).
      num_host_blocks: host blocks including the null block (per replica: every KV shard of a
        replica holds its own share of the same host blocks).
      max_num_seqs: state rows (per replica). num_index_groups: IndexShare groups (full layers).
      max_stores: copies per step and replica (the store list's fixed length).
      policy: the `HiSparsePolicy` whose leases, host tables and copy queue the steps follow, or a
        list of them, one per data-parallel replica.
      parallel: the `ParallelLayout`, or None on one device. The host pool and the hot state are
        then global arrays with one shard per KV shard (replica × DCP rank;
        `glm53.attention.host_pool_spec`, `hot_state_spec`).
    """

    def __init__(self, config: ResolvedHiSparse, mla_layout, num_host_blocks: int, max_num_seqs: int,
                 num_index_groups: int, max_stores: int, policy, parallel=None):
        self.policies = list(policy) if isinstance(policy, (list, tuple)) else [policy]
        self.policy = self.policies[0]
        self.parallel = parallel
        _, comp = mla_layout.component("mla")
        self.tpp = mla_layout.tokens_per_page
        self.mechanism = config.mechanism
        self.num_host_blocks = int(num_host_blocks)
        self.row_words = comp.num_layers * comp.row_words
        self.host_block_bytes = 4 * self.tpp * self.row_words  # one device's share of a host block
        self.hot_rows = config.max_hot_rows
        self.hot_pages = config.max_hot_rows // self.tpp
        self.narrow_rows = config.device_buffer_rows  # a decoding request's lease
        self.max_stores = int(max_stores)
        rows = self.num_host_blocks * self.tpp
        if parallel is None:
            self.num_kv_shards = 1
            self.pool = make_host_pool(self.mechanism, rows, self.row_words)
            # Committed to device memory like the step's outputs, so the step's first call with
            # the state it returned hits the compiled executable (an uncommitted input next to
            # the committed pinned_host pool would key a second compilation).
            scalar = SingleDeviceSharding(jax.devices()[0], memory_kind="device")
            self.hot = jax.device_put(HotState.empty(max_num_seqs, num_index_groups, self.hot_rows), scalar)
        else:
            from jax.sharding import NamedSharding, PartitionSpec

            from glm53.attention import hot_state_spec, num_kv_shards

            self.pool = make_parallel_host_pool(self.mechanism, rows, comp.num_layers, comp.row_words, parallel)
            shards = self.num_kv_shards = num_kv_shards(parallel)
            st = NamedSharding(parallel.mesh, hot_state_spec(parallel))
            scalar = NamedSharding(parallel.mesh, PartitionSpec())
            self.hot = jax.device_put(HotState.empty(shards * max_num_seqs, num_index_groups, self.hot_rows, shards),
                                      HotState(st, st, scalar, scalar))
        # The completion value of the last store program (`store_host_pages`' `done`), which the
        # step passes to its host reads as an operand: with the callback mechanism the reads then
        # depend on the stores' result, so a read never overtakes a store dispatched before it
        # (the callbacks are unordered, and the host pool is outside the arena's donation chain).
        # Same placement as `done`, so the step's first call with a store's value hits the
        # compiled executable.
        self.after = jax.device_put(np.int32(0), scalar)
        self.layer_row_bytes = 4 * comp.row_words  # one layer's row of one token
        self.hits = self.misses = self.dropped = 0  # lookups since start-up
        self.drops_outside_truncation = 0  # steps with dropped selections but no truncated request (a bug)
        self.h2d_bytes = 0  # host → device bytes moved for hot rows since start-up (callback: chunk padding included)
        self.last_stats = (0, 0, 0, 0)  # the last step's hits, misses, dropped, host → device bytes
        self.misses_per_shard = np.zeros(self.num_kv_shards, np.int64)  # misses per KV shard since start-up
        self.host_reads = 0  # host transfers of missed rows since start-up (memory_kind: slices; callback: chunks)

    @property
    def row_bytes(self) -> int:
        """Bytes of one host row (one token, every sparse-MLA layer)."""
        return 4 * self.row_words

    def empty_inputs(self, num_rows: int, width: int) -> HotBatch:
        """An inactive `HotBatch` for `num_rows` batch rows and MLA tables of `width`
        (compilation, steps without hot rows)."""
        return HotBatch(np.zeros((num_rows, width), np.int32), np.zeros((num_rows, self.hot_pages), np.int32),
                        np.full(num_rows, -1, np.int32), np.full(num_rows, self.hot_rows, np.int32),
                        np.bool_(False), np.int32(self.num_host_blocks), np.bool_(True))

    def store_lists(self, jobs) -> tuple[np.ndarray, np.ndarray]:
        """int32 sources (device pages) and destinations (host blocks) of `jobs`, −1 padded to
        `max_stores` (the store program's one shape): `[max_stores]` on one device; under a
        parallel layout `[dp, max_stores]`, `jobs` then being one list per replica (a flat list:
        replica 0's)."""
        per = jobs if self.parallel is not None and jobs and isinstance(jobs[0], (list, tuple)) else [jobs]
        nrep = self.parallel.dp if self.parallel is not None else 1
        src = np.full((nrep, self.max_stores), -1, np.int32)
        dst = np.full((nrep, self.max_stores), -1, np.int32)
        for r, js in enumerate(per):
            src[r, :len(js)] = [j.device_block for j in js]
            dst[r, :len(js)] = [j.host_block for j in js]
        return (src[0], dst[0]) if self.parallel is None else (src, dst)

    def inputs(self, sched, num_rows: int, width: int, replica: int = 0) -> tuple[HotBatch, list]:
        """The step's `HotBatch` for one replica (row i = `sched.scheduled[i]`) and the
        write-through copies to run before it (taken from the replica's policy's copy queue)."""
        policy = self.policies[replica]
        hot = self.empty_inputs(num_rows, width)
        active, widest = False, 0
        for i, sr in enumerate(sched.scheduled):
            rid = sr.request_id
            hot.host_table_BP[i] = policy.host_table(rid, width)
            lease, reset = policy.hot_rows(sr.request, sr.first_chunk)
            if lease:
                active, widest = True, max(widest, len(lease))
                hot.hot_table_BH[i, :len(lease)] = lease
                hot.state_row_B[i] = sr.request.state_row
                hot.reset_from_B[i] = reset
        hot.active = np.bool_(active)
        hot.narrow = np.bool_(widest * self.tpp <= self.narrow_rows)
        return hot, policy.take_stores(self.max_stores)

    def truncations(self, sched, first_drop_S, replica: int = 0) -> dict[str, int]:
        """Requests of `sched` (replica `replica`'s step) whose query rows dropped a hot-buffer
        selection → the smallest such position (`HotState.first_drop_S`, min over the replica's
        KV shards). Rows before it were fully resolved, so the request's chunk is valid up to it
        (`serving.hisparse.truncation`)."""
        drop = np.asarray(first_drop_S)
        S = drop.shape[0] // self.num_kv_shards
        per_replica = self.num_kv_shards // (self.parallel.dp if self.parallel is not None else 1)
        out = {}
        for sr in sched.scheduled:
            row = sr.request.state_row
            if row is None or not 0 <= row < S:
                continue
            first = min(int(drop[(replica * per_replica + d) * S + row]) for d in range(per_replica))
            if first < sr.start_pos + sr.num_new_tokens:
                out[sr.request_id] = first
        return out

    def check_drops(self, stats, truncations: list[dict[str, int]]) -> None:
        """A step whose resolver dropped selections must have truncated some request there (a
        dropped selection in a kept row would be a wrong read): counts and logs the steps where
        it did not (`drops_outside_truncation`, 0 unless the engine has a bug). stats: the step's
        `HotState.stats_Z5` (or its `[5]` sum)."""
        dropped = int(sum_shard_stats(stats)[2])
        if dropped > 0 and not any(truncations):
            self.drops_outside_truncation += 1
            logger.error("HiSparse: the resolver dropped %d selections in a step that truncated no request", dropped)

    def record(self, stats) -> None:
        """Accumulate one step's `[hits, misses, dropped, layer rows moved, host reads]` per KV
        shard (`HotState.stats_Z5`, or their `[5]` sum; `glm53.attention.resolve_hot`), summed
        here in 64-bit. The callback path's rows include the padding of its last chunk, so
        `h2d_bytes` counts the bytes that cross from the host, not misses × row bytes."""
        per_shard = np.asarray(stats, np.int64).reshape(-1, 5)
        if per_shard.shape[0] == self.num_kv_shards:
            self.misses_per_shard += per_shard[:, 1]
        h, m, d, rows, reads = sum_shard_stats(per_shard)
        self.host_reads += reads
        nbytes = rows * self.layer_row_bytes
        self.last_stats = (h, m, d, nbytes)
        self.hits += h
        self.misses += m
        self.dropped += d
        self.h2d_bytes += nbytes


def sum_shard_stats(stats) -> tuple[int, int, int, int, int]:
    """`[hits, misses, dropped, layer rows moved, host reads]` summed over the KV shards in Python
    integers: `stats` is a step's int32 `[Z, 5]` (one row per shard) or an already summed `[5]`."""
    a = np.asarray(stats, np.int64).reshape(-1, 5)
    return tuple(int(x) for x in a.sum(axis=0))


def max_stores_per_step(max_num_batched_tokens: int, max_num_seqs: int, tokens_per_page: int) -> int:
    """Pages one step can seal (every scheduled request may seal ⌈its tokens / tpp⌉ + 1 pages, and
    finishing or preempted requests one more each): the store list's length."""
    return math.ceil(max_num_batched_tokens / tokens_per_page) + 2 * max_num_seqs + 1
