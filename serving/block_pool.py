"""The device block pool: one arena of equal-size pages shared by every KV cache group.

A block id names a page of the device arena (docs/design.md §6.1.1). Every KV cache group (MLA latent,
indexer keys, MTP) and every HiSparse hot lease draws pages from this single pool, so capacity
moves between groups as requests come and go. The pool is pure bookkeeping: it never touches
device memory.

Mechanism (after vLLM v1's `BlockPool`):

* Block 0 is the NULL block. It is never handed out and never freed; block-table placeholders
  point at it, kernels treat its rows as absent and writes to it are dropped.
* Pages are reference-counted. A page whose count drops to 0 joins the free queue; `allocate`
  takes pages from its head. A freed page keeps its contents (and its tag) until it is handed out
  again, so a page that is still in the free queue can be revived with `incref` (prefix-cache
  hits, HiSparse "released" pages).
* A tag (`set_tag`) records who cares about a page's contents after it is freed. When `allocate`
  hands out a freed page that still carries a tag, the tag is cleared and `on_reuse(block,
  old_tag)` is called before `allocate` returns, so the tag's owner learns the contents are gone.
* The free queue has three tiers, handed out in order: untagged pages (nobody cares about their
  contents), then tagged pages freed with `front=True` (contents that are cheap to lose, e.g.
  HiSparse pages backed by a host copy), then the other tagged pages (prefix-cache pages): each
  tier in LRU order (oldest free first). Untagged pages are therefore always reused before any
  cached content is evicted.

All operations are O(1) per page. `audit()` checks the invariants and returns violations as
strings (an empty list means consistent).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, Callable, Iterable

NULL_BLOCK = 0

ReuseCallback = Callable[[int, Any], None]


class NoFreeBlocksError(RuntimeError):
    """Raised by `BlockPool.allocate` when fewer pages are free than requested."""


class BlockPool:
    """Reference-counted pages with an LRU free queue and a reuse callback.

    Args:
      num_blocks: total pages in the arena, including the NULL block 0 (so `num_blocks - 1`
        pages can be handed out). Must be >= 2.
      on_reuse: optional `callable(block, old_tag)`, called by `allocate` for every page it hands
        out that was freed while carrying a tag. It runs after the page has left the free queue
        (refcount 1, tag cleared) and before `allocate` returns. It must not raise and must not
        allocate or free pages itself.

    Raises:
      ValueError: num_blocks < 2.
    """

    def __init__(self, num_blocks: int, on_reuse: ReuseCallback | None = None):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = int(num_blocks)
        self.on_reuse = on_reuse
        self._refcount: list[int] = [0] * self.num_blocks
        # The three tiers of the free queue (module docstring). In each, the head (first) is the
        # next page handed out and the tail (last) the most recently freed one.
        self._untagged: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, self.num_blocks))
        self._front: OrderedDict[int, None] = OrderedDict()
        self._tagged: OrderedDict[int, None] = OrderedDict()
        self._tags: dict[int, Any] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_usable_blocks(self) -> int:
        """Pages that can ever be handed out (`num_blocks - 1`: the NULL block is excluded)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Pages in the free queue (refcount 0), including freed pages that still carry a tag."""
        return len(self._untagged) + len(self._front) + len(self._tagged)

    def usage(self) -> float:
        """Fraction of the non-null pages currently held (refcount > 0), in [0, 1]."""
        return (self.num_usable_blocks - self.num_free) / self.num_usable_blocks

    def refcount(self, block: int) -> int:
        """Number of holders of `block` (0 for a free page and for the NULL block)."""
        self._check_id(block)
        return self._refcount[block]

    def is_free(self, block: int) -> bool:
        """True when `block` sits in the free queue (refcount 0, contents kept until reuse)."""
        self._check_id(block)
        return self._tier(block) is not None

    def get_tag(self, block: int) -> Any:
        """The tag of `block`, or None."""
        self._check_id(block)
        return self._tags.get(block)

    def free_queue(self) -> list[int]:
        """The free queue in the order `allocate` hands pages out (untagged, then front-freed
        tagged, then other tagged pages; each oldest first); O(n)."""
        return list(self._untagged) + list(self._front) + list(self._tagged)

    def _tier(self, block: int) -> OrderedDict | None:
        for q in (self._untagged, self._front, self._tagged):
            if block in q:
                return q
        return None

    def _pop_head(self) -> int:
        for q in (self._untagged, self._front, self._tagged):
            if q:
                return q.popitem(last=False)[0]
        raise NoFreeBlocksError("no free page")

    # ------------------------------------------------------------------ mutations

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages from the head of the free queue, each with refcount 1.

        Pages that were freed while tagged have their tag cleared and `on_reuse(block, old_tag)`
        called, in allocation order, before this returns.

        Raises:
          ValueError: n < 0.
          NoFreeBlocksError: fewer than n pages are free; nothing is allocated.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self.num_free:
            raise NoFreeBlocksError(f"requested {n} pages, {self.num_free} free")
        blocks: list[int] = []
        reused: list[tuple[int, Any]] = []
        for _ in range(n):
            block = self._pop_head()
            self._refcount[block] = 1
            if block in self._tags:
                reused.append((block, self._tags.pop(block)))
            blocks.append(block)
        if self.on_reuse is not None:
            for block, tag in reused:
                self.on_reuse(block, tag)
        return blocks

    def free(self, blocks: Iterable[int], front: bool = False) -> None:
        """Drop one reference to each page; pages reaching 0 go to the tail of the free queue.

        Pages are appended in the order given, so a caller that wants the tail of a sequence
        reused first passes it tail-first. Tags are kept (the contents stay readable until the
        page is handed out again). NULL_BLOCK entries are ignored (placeholders own nothing).
        A page may appear several times if it holds that many references.

        front: tagged pages join the front tier (handed out after untagged pages, before other
        tagged ones; module docstring), in the order given: for pages whose contents are cheap to
        lose (HiSparse MLA pages backed by a host copy), so that cached pages nobody else holds a
        copy of (indexer pages) stay longer. Untagged pages always join the untagged tier.

        Raises:
          ValueError: an id out of range, or a page freed more often than it is referenced
            (double free); nothing is changed.
        """
        blocks = [int(b) for b in blocks if b != NULL_BLOCK]
        for block, count in Counter(blocks).items():
            self._check_id(block)
            if self._refcount[block] < count:
                raise ValueError(
                    f"double free of block {block} (refcount {self._refcount[block]}, "
                    f"freed {count} times)"
                )
        for block in blocks:
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if block not in self._tags:
                    self._untagged[block] = None
                else:
                    (self._front if front else self._tagged)[block] = None

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each page (sharing). A free page is revived: it leaves the free
        queue with refcount 1 and keeps its contents and tag. NULL_BLOCK entries are ignored.

        Raises:
          ValueError: an id out of range; nothing is changed.
        """
        blocks = [int(b) for b in blocks if b != NULL_BLOCK]
        for block in blocks:
            self._check_id(block)
        for block in blocks:
            if self._refcount[block] == 0:
                del self._tier(block)[block]
            self._refcount[block] += 1

    def claim(self, block: int) -> None:
        """Hand out one specific free page (refcount 1), as `allocate` would: a tag it carries is
        cleared and reported to `on_reuse` before this returns. Contents are kept, so the new
        owner may go on from what the page holds.

        Raises:
          ValueError: the page is out of range, the NULL_BLOCK or not free.
        """
        self._check_id(block)
        tier = self._tier(block)
        if tier is None:
            raise ValueError(f"block {block} is not free")
        del tier[block]
        self._refcount[block] = 1
        tag = self._tags.pop(block, None)
        if tag is not None and self.on_reuse is not None:
            self.on_reuse(block, tag)

    def set_tag(self, block: int, tag: Any) -> None:
        """Attach `tag` (any non-None value) to `block`, replacing an earlier tag.

        Raises:
          ValueError: block is NULL_BLOCK or out of range, or tag is None.
        """
        self._check_id(block)
        if block == NULL_BLOCK:
            raise ValueError("the null block cannot be tagged")
        if tag is None:
            raise ValueError("tag must not be None (use clear_tag)")
        self._tags[block] = tag
        if block in self._untagged:  # a free page whose contents now matter: last of the tagged
            del self._untagged[block]
            self._tagged[block] = None

    def clear_tag(self, block: int) -> Any:
        """Remove and return the tag of `block` (None when it had none). A free page moves to the
        tail of the untagged tier."""
        self._check_id(block)
        tier = self._tier(block)
        if tier is not None and tier is not self._untagged:
            del tier[block]
            self._untagged[block] = None
        return self._tags.pop(block, None)

    # ------------------------------------------------------------------ checks

    def audit(self) -> list[str]:
        """Check the pool's invariants; returns one string per violation (empty when consistent).

        Checked: refcounts never negative; the NULL block has refcount 0, no tag and is not
        queued; every queued page is in range, queued once and has refcount 0 (not both free and
        owned), untagged pages sit in the untagged tier and tagged ones in a tagged tier; every
        non-null page with refcount 0 is queued (none missing from both).
        """
        errors: list[str] = []
        if len(self._refcount) != self.num_blocks:
            errors.append(
                f"refcount table has {len(self._refcount)} entries, expected {self.num_blocks}"
            )
        for block, rc in enumerate(self._refcount):
            if rc < 0:
                errors.append(f"block {block} has negative refcount {rc}")
        if self._refcount[NULL_BLOCK] != 0:
            errors.append(f"null block has refcount {self._refcount[NULL_BLOCK]}")
        if NULL_BLOCK in self._tags:
            errors.append("null block carries a tag")
        seen: set[int] = set()
        for name, tier in (("untagged", self._untagged), ("front", self._front), ("tagged", self._tagged)):
            for block in tier:
                if block in seen:
                    errors.append(f"block {block} appears twice in the free queue")
                seen.add(block)
                if block == NULL_BLOCK:
                    errors.append("null block is in the free queue")
                elif not 0 < block < self.num_blocks:
                    errors.append(f"free queue holds out-of-range block {block}")
                elif self._refcount[block] != 0:
                    errors.append(
                        f"block {block} is both free and owned (refcount {self._refcount[block]})"
                    )
                if (block in self._tags) == (name == "untagged"):
                    errors.append(f"block {block} sits in the {name} tier with tag {self._tags.get(block)!r}")
        for block in range(1, self.num_blocks):
            if self._refcount[block] == 0 and block not in seen:
                errors.append(f"block {block} is neither free nor owned")
        for block in self._tags:
            if not 0 <= block < self.num_blocks:
                errors.append(f"tag on out-of-range block {block}")
        return errors

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} out of range [0, {self.num_blocks})")
