"""The model runner's host-memory transfer programs around a step: Hybrid HiSparse's write-through
page copies (arena → host pool) and the offloading connector's stores and loads, each its own
program dispatched before the step that needs it, plus the HiSparse state the step donates and
returns (`HostTransfersMixin`, mixed into `serving.runner.ModelRunner`, which provides the arena,
`hisparse`, `offload`, `_put`, `step_sink` and the jitted store program).
"""

from __future__ import annotations

import jax
import numpy as np


class HostTransfersMixin:
    """HiSparse copies and offloading-connector transfers (module docstring)."""

    def run_stores(self, jobs, wait: bool = False) -> None:
        """HiSparse: dispatch the write-through copies `jobs` (`serving.hisparse.host_pool.CopyJob`,
        at most `max_stores`; under data parallelism one list per replica) as their own program
        over the current arena (one fixed shape: the list is −1 padded). Call it before the step
        that should see them complete; `wait` blocks until they ran (an idle engine flushing its
        queue)."""
        src, dst = self.hisparse.store_lists(jobs)
        self.run_store_lists(src, dst, wait)

    def run_store_lists(self, src: np.ndarray, dst: np.ndarray, wait: bool = False) -> None:
        """`run_stores` on the padded int32 lists of `HiSparseDeviceState.store_lists` (what a
        multi-host leader sends its followers before running them itself)."""
        if self.step_sink is not None:
            self.step_sink("stores", (src, dst, np.bool_(wait)))
        self.hisparse.pool, done = self._store_only(self.hisparse.pool, self.kv_arena, self._put(src), self._put(dst))
        self.hisparse.after = done  # the next steps' host reads take it as an operand
        if wait:
            jax.block_until_ready(done)

    def run_offload(self, loads, wait: bool = False) -> None:
        """The offloading connector's transfers before a step: every queued store (host block ←
        arena page, pages computed by earlier steps) as one program, then the step's `loads`
        (`(host block, device page)`: arena page ← host block) as another, which donates the
        arena to the step. `loads` has one list per data-parallel replica (one list without data
        parallelism), each replica's stores come from its own host store's queue. `wait` blocks
        until the stores ran (an idle engine flushing)."""
        stores = []
        for store in self.offload.stores:
            jobs = store.take_stores(len(store.queue))
            stores.append([(j.device_block, j.host_block) for j in jobs])
        self.run_offload_lists(stores, loads, wait)

    def run_offload_lists(self, stores, loads, wait: bool = False) -> None:
        """`run_offload` on explicit per-replica lists: `stores[r]` of `(device block, host block)`,
        `loads[r]` of `(host block, device block)` (what a multi-host leader sends its followers,
        as `(replica, a, b)` rows, before running them itself)."""
        stores = [[tuple(int(x) for x in p) for p in per] for per in stores]
        loads = [[tuple(int(x) for x in p) for p in per] for per in loads]
        if self.step_sink is not None and (any(stores) or any(loads) or wait):
            self.step_sink("offload", (_tagged(stores), _tagged(loads), np.bool_(wait)))
        transfer = self.offload.transfer
        if any(stores):
            transfer.store(self.kv_arena, stores)
        if any(loads):
            self.kv_arena = transfer.load(self.kv_arena, loads)
        if wait:
            transfer.wait()

    def _dispatch_stores(self) -> None:
        """HiSparse: run the write-through copies `prepare` took from the policies (one list per
        replica), before the step."""
        if self.hisparse is None:
            return
        jobs = [self._store_jobs.get(r, []) for r in range(self.dp)]
        self._store_jobs = {}
        if any(jobs):
            self.run_stores(jobs if self.parallel is not None else jobs[0])

    def _hisparse_args(self):
        """The step's `hs` argument: None or (hot state, host pool, the last store program's
        completion value)."""
        if self.hisparse is None:
            return None
        return self.hisparse.hot, self.hisparse.pool, self.hisparse.after

    def _keep_hisparse(self, hs) -> None:
        """Take back the donated HiSparse state the step returned."""
        if hs is not None:
            self.hisparse.hot, self.hisparse.pool, self.hisparse.after = hs


def _tagged(per_replica) -> np.ndarray:
    """`int32[n, 3]` rows `(replica, a, b)` of per-replica `(a, b)` pair lists (the step channel's
    form of `run_offload_lists`' arguments; `untag` inverts it)."""
    rows = [(r, a, b) for r, pairs in enumerate(per_replica) for a, b in pairs]
    return np.asarray(rows, np.int32).reshape(-1, 3)


def untag(rows: np.ndarray, num_replicas: int) -> list[list[tuple[int, int]]]:
    """Per-replica pair lists of `_tagged`'s rows."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(num_replicas)]
    for r, a, b in np.asarray(rows).reshape(-1, 3).tolist():
        out[r].append((a, b))
    return out
