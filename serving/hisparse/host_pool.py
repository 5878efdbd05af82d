"""The HiSparse host pool's bookkeeping: host blocks and the write-through copy queue.

A host block holds one MLA page — 64 tokens of every sparse-MLA layer — in host memory (the
array itself belongs to the model runner: a `pinned_host` `jax.Array` or a numpy
`HostRowStore`, `kernels/host_rows`). Blocks are reference-counted in a `BlockPool` (block 0 is
the null block): a running request holds one reference to the host copy of each of its pages, and
a queued or in-flight copy holds one more until it completes. A freed block keeps its contents and
its prefix-cache tag until the pool hands it out again (LRU), so host copies of finished
requests' prefixes stay reusable (the host tier of `serving/prefix_cache.py`).

Copies (`CopyJob`, device page → host block) are queued when a page is sealed (all its positions
computed), run at the start of the next step inside the jitted program, before anything in that
step writes the arena (`take_stores`), and are complete once that step has finished
(`complete`): only then is the page *clean* (docs/design.md §6.1: a page is clean only once its copy is
complete). Host destinations are computed from what the steps actually computed
(`num_computed_tokens` after the step), so rolled-back tokens are never taken as durable.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from serving.block_pool import BlockPool
from serving.copy_queue import CopyQueue


@dataclass(eq=False)
class CopyJob:
    """One queued write-through copy: arena page `device_block` → host block `host_block`.

    owner: the request's residency record that wants the page clean (identity; the record may
    be gone when the copy completes). page_index: the page's index in that request's table.
    key: the page's prefix-cache unit hash (published in the host tier on completion), or None.
    """

    device_block: int
    host_block: int
    owner: Any
    page_index: int
    key: bytes | None = None


class HostPool(CopyQueue[CopyJob]):
    """Host blocks (a `BlockPool`, block 0 null) and the copy queue.

    Args:
      num_blocks: host blocks including the null block.
      on_reuse: the `BlockPool` reuse callback (route it to the prefix cache's host tier).
    """

    def __init__(self, num_blocks: int, on_reuse=None):
        super().__init__()
        self.blocks = BlockPool(num_blocks, on_reuse=on_reuse)
        self.num_copied = 0  # pages copied so far

    @property
    def num_usable(self) -> int:
        return self.blocks.num_usable_blocks

    def usage(self) -> float:
        """Fraction of the host blocks referenced (by requests or copies), in [0, 1]."""
        return self.blocks.usage()

    def allocate(self) -> int | None:
        """One host block with one reference, or None when none is free."""
        if self.blocks.num_free == 0:
            return None
        return self.blocks.allocate(1)[0]

    def enqueue(self, job: CopyJob) -> None:
        """Queue a copy; it takes one more reference to its host block until it completes."""
        self.blocks.incref([job.host_block])
        self.queue.append(job)

    def cancel(self, owner) -> None:
        """Drop the queued (not yet running) copies of `owner`, releasing their references."""
        keep = deque(j for j in self.queue if j.owner is not owner)
        for j in self.queue:
            if j.owner is owner:
                self.blocks.free([j.host_block])
        self.queue = keep

    def take_stores(self, max_copies: int) -> list[CopyJob]:
        """Move up to `max_copies` queued copies in flight (they run in the step being built)."""
        return self.take(max_copies)

    def complete(self) -> list[CopyJob]:
        """The in-flight copies finished (their step ran); returns them. The caller marks pages
        clean, publishes them and drops each copy's reference (`release`)."""
        done = self.finish()
        self.num_copied += len(done)
        return done

    def release(self, job: CopyJob) -> None:
        """Drop a completed copy's reference to its host block."""
        self.blocks.free([job.host_block])

    def audit(self, request_refs: dict[int, int]) -> list[str]:
        """Pool invariants, and every block's refcount = references held by requests
        (`request_refs`: block → count) + queued and in-flight copies."""
        errors = [f"host pool: {e}" for e in self.blocks.audit()]
        owners: dict[int, int] = dict(request_refs)
        for j in list(self.queue) + self.in_flight:
            owners[j.host_block] = owners.get(j.host_block, 0) + 1
        for b in range(1, self.blocks.num_blocks):
            rc = self.blocks.refcount(b)
            if rc != owners.get(b, 0):
                errors.append(f"host block {b}: refcount {rc} but {owners.get(b, 0)} holders (leaked or double-owned)")
        return errors
