"""The offloading connector's host store: block-granular, keyed by prefix-cache hashes, with its own LRU.

A host block holds one whole arena page of one KV cache group (any group: MLA latent, indexer
keys, MTP), filed under `(group, key)` where `key` is the prefix cache's chained hash of the
page's last unit (`serving/prefix_cache.py`): the page's rows hold the KV of the prefix that key
names. Only full pages are stored (every position of the page computed).

Blocks are reference-counted in their own `BlockPool` (block 0 null). A queued or in-flight store
holds one reference; a filed block holds none (it sits in the pool's free queue with its tag, so
the least recently filed or used block is the first one a new store takes: the store's LRU, and
the pool's reuse callback drops the entry). A load pins its source block (one reference) from
the admission that plans it until the step it was planned for has run, so no store can take the
block in between.

Ordering (the engine's step): the stores queued after step N (`queue_store`, called while the
prefix cache publishes newly computed units) run as their own program before step N+1, then the
loads of step N+1's admissions (`SchedulerOutput.page_loads`), then step N+1 itself; a store is
filed (`complete`) only after that step ran, so a lookup never finds a block whose store has not
run, a load never reads a block a store is writing (it is not filed yet; a filed block cannot be
taken while pinned), and a step never reads a page whose load has not completed (the load
program donates the arena to the step: a data dependency). With asynchronous scheduling the
engine files the stores and unpins the loads as soon as their step was dispatched: every program
that could read a filed block or overwrite a released one is dispatched later and ordered after
them through the arena (serving/async_scheduling.py, the page rule).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from serving.block_pool import BlockPool
from serving.copy_queue import CopyQueue

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadTag:
    """The pool tag of a filed host block."""

    group: str
    key: bytes


@dataclass(eq=False)
class StoreJob:
    """One queued store: arena page `device_block` → host block `host_block`, to be filed under
    `(group, key)` once it ran."""

    device_block: int
    host_block: int
    group: str
    key: bytes


class OffloadStore(CopyQueue[StoreJob]):
    """Host-side bookkeeping of the connector (module docstring).

    Args:
      num_blocks: host blocks including the null block (`OffloadConfig.host_blocks`).
      groups: the KV cache groups the connector manages (every group, or with Hybrid HiSparse the
        groups HiSparse does not manage).
      page_bytes: bytes of one page (for the byte counters).
    """

    def __init__(self, num_blocks: int, groups, page_bytes: int):
        super().__init__()
        self.blocks = BlockPool(num_blocks, on_reuse=self._on_reuse)
        self.groups = tuple(groups)
        self.page_bytes = int(page_bytes)
        self._entries: dict[tuple[str, bytes], int] = {}
        self._filed: dict[int, OffloadTag] = {}
        self._queued: set[tuple[str, bytes]] = set()
        self.pinned: list[int] = []
        # Told when a page is filed or its host block handed out again (`on_offload_filed(group,
        # key)` / `on_offload_dropped(group, key)`): the prefix cache, with KV events on.
        self.listener = None
        # Totals since start-up (pages; bytes = pages × page_bytes).
        self.num_stored = 0
        self.num_loaded = 0
        self.num_skipped = 0  # stores dropped: every host block was queued, in flight or pinned

    @property
    def num_usable(self) -> int:
        return self.blocks.num_usable_blocks

    @property
    def num_filed(self) -> int:
        return len(self._entries)

    def usage(self) -> float:
        """Fraction of host blocks filed, queued or pinned, in [0, 1]."""
        return (self.num_usable - self.blocks.num_free + len(self._filed)) / max(1, self.num_usable)

    # ------------------------------------------------------------------ lookup
    def lookup(self, group: str, key: bytes) -> int | None:
        """The filed host block of `(group, key)`, or None."""
        return self._entries.get((group, key))

    def is_filed(self, group: str, key: bytes, block: int) -> bool:
        """True while `block` is still filed under `(group, key)`."""
        return self._entries.get((group, key)) == block

    # ------------------------------------------------------------------ stores
    def queue_store(self, group: str, key: bytes, device_block: int) -> bool:
        """Queue a store of a full page unless `(group, key)` is filed or queued already. Returns
        True when queued (False also when no host block is free: the store is skipped)."""
        if group not in self.groups or (group, key) in self._entries or (group, key) in self._queued:
            return False
        if self.blocks.num_free == 0:
            if not self.num_skipped:
                logger.warning("KV offloading connector: its host store's %d blocks are all in use; full pages are "
                               "not stored while none is free (counted in vllm:kv_offload_stores_skipped_total; "
                               "cpu_bytes_to_use sizes the store)", self.num_usable)
            self.num_skipped += 1
            return False
        host = self.blocks.allocate(1)[0]
        self._queued.add((group, key))
        self.queue.append(StoreJob(int(device_block), host, group, key))
        return True

    def take_stores(self, max_jobs: int) -> list[StoreJob]:
        """Move up to `max_jobs` queued stores in flight (they run before the next step).
        Raises RuntimeError when the previous ones were not completed."""
        return self.take(max_jobs)

    def complete(self) -> list[StoreJob]:
        """The in-flight stores ran (their step finished): file each block under its key and
        drop the store's reference (the block joins the LRU free queue with its tag)."""
        done = self.finish()
        for job in done:
            tag = OffloadTag(job.group, job.key)
            self.blocks.set_tag(job.host_block, tag)
            self._filed[job.host_block] = tag
            self._entries[(job.group, job.key)] = job.host_block
            self._queued.discard((job.group, job.key))
            self.blocks.free([job.host_block])
            if self.listener is not None:
                self.listener.on_offload_filed(job.group, job.key)
        self.num_stored += len(done)
        return done

    # ------------------------------------------------------------------ loads
    def pin(self, blocks) -> None:
        """Hold the source blocks of planned loads until `unpin` (after their step ran)."""
        blocks = [int(b) for b in blocks]
        self.blocks.incref(blocks)
        self.pinned.extend(blocks)
        self.num_loaded += len(blocks)

    def unpin(self) -> None:
        """The loads planned so far ran: release their source blocks (most recently used)."""
        pinned, self.pinned = self.pinned, []
        self.blocks.free(pinned)

    # ------------------------------------------------------------------ eviction
    def _on_reuse(self, block: int, tag) -> None:
        if isinstance(tag, OffloadTag) and self._filed.get(block) == tag:
            del self._filed[block]
            del self._entries[(tag.group, tag.key)]
            if self.listener is not None:
                self.listener.on_offload_dropped(tag.group, tag.key)

    # ------------------------------------------------------------------ checks
    def audit(self) -> list[str]:
        """Pool invariants; entries and filed blocks agree and carry their tags; every referenced
        block is queued, in flight or pinned."""
        errors = [f"offload store: {e}" for e in self.blocks.audit()]
        if len(self._entries) != len(self._filed):
            errors.append("offload store: entry indexes disagree in size")
        for (group, key), block in self._entries.items():
            tag = self._filed.get(block)
            if tag != OffloadTag(group, key) or self.blocks.get_tag(block) != tag:
                errors.append(f"offload store: host block {block} is filed inconsistently")
        refs: dict[int, int] = {}
        for b in [j.host_block for j in list(self.queue) + self.in_flight] + self.pinned:
            refs[b] = refs.get(b, 0) + 1
        for b in range(1, self.blocks.num_blocks):
            if self.blocks.refcount(b) != refs.get(b, 0):
                errors.append(f"offload store: host block {b} has {self.blocks.refcount(b)} references, "
                              f"{refs.get(b, 0)} accounted for")
        return errors
