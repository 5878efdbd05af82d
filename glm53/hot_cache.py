"""What the model sees of Hybrid HiSparse (docs/design.md §6.1, §6.1.1): per-step hot inputs, the
per-request hot state carried through the forward pass, and access to the host pool.

Under HiSparse some of a request's MLA pages are no longer on the device (their block-table entry
is the null block) and their rows live in a host pool. Each IndexShare group's full layer resolves
its top-k through `glm53.attention.resolve_hot`: resident positions are read in place, the others
through the request's hot buffer (ordinary arena pages leased from the pool), copying missed
rows — all layers of the group at once — from the host pool inside the step. The group's shared
layers reuse the resolved slots.

* `HotBatch` (per step, int32): the host block of every MLA page, the hot pages of each request,
  its state row and how much of its hot state is stale; `active` is False when no request of the
  step has a hot lease (the resolver is then skipped and the step reads exactly as without
  HiSparse).
* `HotState` (carried, donated between steps): per state row and IndexShare group, the host row
  each hot slot holds and its LRU rank (`kernels/hot_resolve`), plus this step's lookup counters.
* `PagedKV`: the arena and the hot state, threaded through the layers as one pytree.
* `HostAccess`: the host pool (a `pinned_host` `jax.Array` or a `HostRowStore`), the transfer
  mechanism and a value the pool reads are ordered after (`kernels/host_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class HotBatch:
    """Per-step HiSparse inputs.

    host_table_BP: int32 `[B, P]` host-pool block of each MLA page of each batch row (0 = none).
    hot_table_BH: int32 `[B, H]` hot-lease pages of each batch row (0 = none); hot slot j lives in
        page `hot_table[b, j // tpp]` at offset `j % tpp`.
    state_row_B: int32 `[B]` row of the request in `HotState` (−1 = no hot lease this step).
    reset_from_B: int32 `[B]` hot slots j ≥ this are stale (new owner, changed pages) and cleared.
    active: bool scalar, True when some batch row has a hot lease.
    num_host_blocks: int32 scalar, the host pool's blocks (host rows < num_host_blocks · tpp).
    narrow: bool scalar, True when every lease of the step fits `HostAccess.narrow_rows` hot
        slots (the decode lease): the resolver then works over that width only.
    """

    host_table_BP: jax.Array
    hot_table_BH: jax.Array
    state_row_B: jax.Array
    reset_from_B: jax.Array
    active: jax.Array
    num_host_blocks: jax.Array
    narrow: jax.Array = False


NO_DROP = 2**31 - 1  # `HotState.first_drop_S`: no dropped selection


@jax.tree_util.register_dataclass
@dataclass
class HotState:
    """Per-request hot state of every IndexShare group (int32; donated between steps).

    host_row_SGM: `[S, G, M]` host row held by hot slot j of state row s in index group g (−1 =
    empty). rank_SGM: `[S, G, M]` its LRU rank (0 = least recently used). stats_Z5: int32 `[Z, 5]`,
    this step's `[hits, misses, dropped, layer rows copied, host reads]` per KV shard (Z = replicas × DCP ranks
    under a parallel layout, gathered replicated; 1 on one device), summed over the groups (a miss
    of a group of n layers copies n layer rows; host reads: the host transfers that moved them, see
    `kernels.host_rows.host_reads`; zeroed by the caller per step). The host sums the
    shards in 64-bit (`serving.hisparse.device_state`): one shard's step stays far inside int32
    where a sum over 64 shards of a GLM-5.3 prefill step would not. first_drop_S: int32 `[S]`, this
    step's smallest request-local position of a query row with a dropped selection, per state row
    (`NO_DROP` = none; min over the groups and, under a parallel layout, over the KV shards, whose
    state rows it lists shard-major and replicated; reset by the caller per step; None: not
    recorded). A prefill chunk sized past the worst case (`serving/hisparse/residency.py`) is
    valid up to that position and is truncated there.
    """

    host_row_SGM: jax.Array
    rank_SGM: jax.Array
    stats_Z5: jax.Array
    first_drop_S: jax.Array | None = None

    @classmethod
    def empty(cls, num_state_rows: int, num_index_groups: int, hot_rows: int, num_kv_shards: int = 1) -> "HotState":
        """A fresh state: every slot empty, ranks 0 … M−1 (slot order), nothing dropped."""
        shape = (num_state_rows, num_index_groups, hot_rows)
        return cls(jnp.full(shape, -1, jnp.int32),
                   jnp.broadcast_to(jnp.arange(hot_rows, dtype=jnp.int32), shape),
                   jnp.zeros((num_kv_shards, 5), jnp.int32), jnp.full(num_state_rows, NO_DROP, jnp.int32))

    def for_step(self) -> "HotState":
        """The state a step starts from: counters zeroed, no drop recorded."""
        drop = None if self.first_drop_S is None else jnp.full_like(self.first_drop_S, NO_DROP)
        return HotState(self.host_row_SGM, self.rank_SGM, jnp.zeros_like(self.stats_Z5), drop)


@jax.tree_util.register_dataclass
@dataclass
class PagedKV:
    """The KV arena `uint32[num_blocks, page_words]` and, under HiSparse, the hot state."""

    arena: jax.Array
    hot: HotState | None = None

    def with_arena(self, arena: jax.Array) -> "PagedKV":
        return replace(self, arena=arena)


@partial(jax.tree_util.register_dataclass, data_fields=["pool", "after"], meta_fields=["mechanism", "narrow_rows"])
@dataclass(frozen=True)
class HostAccess:
    """How the forward pass reads the host pool: `pool` (a `pinned_host` `jax.Array` for the
    "memory_kind" mechanism, a `kernels.host_rows.HostRowStore` for "callback"), the `mechanism`
    name, `after`, an array the reads are ordered after, and `narrow_rows` (static), the hot slots
    of a decode lease (steps whose leases all fit it resolve over that width; None: always the
    full state width)."""

    pool: Any
    mechanism: str
    after: Any = field(default=None)
    narrow_rows: int | None = None
