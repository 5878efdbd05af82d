"""KV cache groups and per-request block tables over one shared `BlockPool`.

Every group (MLA latent, indexer keys, MTP, ...) draws pages from the same pool: pages are the
same size in bytes, and each group picks its own `tokens_per_page` so that its per-token record
fits a page (docs/design.md §4.1, §6.1.1). Freeing pages of one group therefore makes room for any other
group. A request holds one block table per group: entry `i` covers the request's logical
positions `[i * tpp, (i + 1) * tpp)` and the slot of position `p` is
`table[p // tpp] * tpp + p % tpp` in that group's view of the arena.

A table entry is in one of three states:

* owned: the request holds one reference to the page (the normal case);
* released: the request gave its reference back to the pool with a tag (`release_page`; a page
  several requests share goes back only from all of them together, `release_shared_page`), the
  block id stays in the table and the page stays readable until the pool hands it out again
  (HiSparse "released"); `revive_page` takes it back while it is still intact;
* placeholder: the entry is `NULL_BLOCK` on purpose (HiSparse "lost" pages, host-only prefixes).

Only owned entries are written to; the newest pages of a request are always owned.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from serving.block_pool import NULL_BLOCK, BlockPool

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: a set of layers whose caches share block ids.

    name: the group's key (e.g. "mla", "indexer").
    tokens_per_page: logical token positions covered by one page of this group. 64 for the MLA
        latent group; larger for groups with smaller per-token records (indexer keys). Under DCP
        with N ranks a page may span 64 x N logical tokens (each rank storing its round-robin
        share); the bookkeeping here only needs the number.

    Raises:
      ValueError: empty name or tokens_per_page < 1.
    """

    name: str
    tokens_per_page: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("group name must be non-empty")
        if self.tokens_per_page < 1:
            raise ValueError(f"tokens_per_page must be >= 1, got {self.tokens_per_page}")


@dataclass(frozen=True)
class ReleasedPageTag:
    """The pool tag put on a page released by `KVCacheManager.release_page`."""

    request_id: str
    group: str
    page_index: int


@dataclass(eq=False)
class SharedReleaseTag:
    """The pool tag put on a page released by all of its sharers together
    (`KVCacheManager.release_shared_page`): a page that several requests hold (a prefix-cache
    hit) goes back to the pool only when every holder gives its reference back at once.

    group: the group the page belongs to.
    sharers: request id → page index, for the sharers whose entry is still released (a sharer that
        finishes leaves; the page's tag is cleared when the last one does). Compared by identity.
    """

    group: str
    sharers: dict[str, int]


@dataclass
class BlockTable:
    """One request's pages in one group.

    blocks: block id per logical page index (NULL_BLOCK for placeholders).
    released: page index -> pool tag, for entries whose reference was given back to the pool.
    placeholders: page indices whose entry is NULL_BLOCK on purpose.
    Every other entry is owned (the request holds one reference to the page).
    """

    blocks: list[int] = field(default_factory=list)
    released: dict[int, Any] = field(default_factory=dict)
    placeholders: set[int] = field(default_factory=set)

    def is_owned(self, page_index: int) -> bool:
        """True when the entry at page_index holds a reference to its page."""
        return page_index not in self.released and page_index not in self.placeholders

    def owned_blocks(self) -> list[int]:
        """Blocks the request holds a reference to, in page order."""
        return [b for i, b in enumerate(self.blocks) if self.is_owned(i)]


class KVCacheManager:
    """Per-request block tables for several KV cache groups sharing one `BlockPool`.

    Args:
      pool: the shared pool.
      group_specs: the groups, in a fixed order (names unique).
      max_blocks_per_request: optional cap on a table's length per group name (missing: no cap);
        the width of the device-side block-table arrays.

    Raises:
      ValueError: no groups, duplicate names, a cap for an unknown group or < 1, or slots that
        would not fit int32.
    """

    def __init__(
        self,
        pool: BlockPool,
        group_specs: Sequence[KVCacheGroupSpec],
        max_blocks_per_request: Mapping[str, int] | None = None,
    ):
        if not group_specs:
            raise ValueError("at least one KV cache group is required")
        names = [g.name for g in group_specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate KV cache group names: {names}")
        caps = dict(max_blocks_per_request or {})
        for name, cap in caps.items():
            if name not in names:
                raise ValueError(f"max_blocks_per_request names unknown group {name!r}")
            if cap < 1:
                raise ValueError(f"max_blocks_per_request[{name!r}] must be >= 1, got {cap}")
        for g in group_specs:
            if pool.num_blocks * g.tokens_per_page - 1 > _INT32_MAX:
                raise ValueError(f"group {g.name!r}: slot ids would overflow int32")
        self.pool = pool
        self.groups: tuple[KVCacheGroupSpec, ...] = tuple(group_specs)
        self._spec = {g.name: g for g in self.groups}
        self.max_blocks_per_request: dict[str, int | None] = {n: caps.get(n) for n in names}
        self._tables: dict[str, dict[str, BlockTable]] = {}
        self._page_copies: list[tuple[int, int]] = []
        self._page_loads: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ queries

    def group(self, name: str) -> KVCacheGroupSpec:
        """The spec of group `name`. Raises KeyError for an unknown group."""
        return self._spec[name]

    def request_ids(self) -> list[str]:
        """Requests that currently have block tables."""
        return list(self._tables)

    def has_request(self, request_id: str) -> bool:
        """True when the request has block tables (possibly empty)."""
        return request_id in self._tables

    def max_tokens_per_request(self) -> int | None:
        """Most token positions one request's tables can cover (min over capped groups)."""
        caps = [
            cap * self._spec[n].tokens_per_page
            for n, cap in self.max_blocks_per_request.items()
            if cap is not None
        ]
        return min(caps) if caps else None

    def pages_for_tokens(self, num_tokens: int) -> dict[str, int]:
        """Pages each group needs to cover `num_tokens` positions from scratch."""
        return {g.name: math.ceil(num_tokens / g.tokens_per_page) for g in self.groups}

    def blocks_needed(self, request: str | int, new_total_tokens: int) -> dict[str, int]:
        """Pages each group must add so that `new_total_tokens` positions fit.

        request: a request id (its current table lengths count as held; unknown ids hold
            nothing), or an int: the number of positions already covered.

        Raises:
          ValueError: new_total_tokens < 0, or a table would exceed max_blocks_per_request.
        """
        if new_total_tokens < 0:
            raise ValueError(f"new_total_tokens must be >= 0, got {new_total_tokens}")
        needed: dict[str, int] = {}
        for g in self.groups:
            total = math.ceil(new_total_tokens / g.tokens_per_page)
            cap = self.max_blocks_per_request[g.name]
            if cap is not None and total > cap:
                raise ValueError(
                    f"{new_total_tokens} tokens need {total} pages in group {g.name!r}, "
                    f"max_blocks_per_request is {cap}"
                )
            if isinstance(request, str):
                held = len(self._tables[request][g.name].blocks) if request in self._tables else 0
            else:
                held = math.ceil(int(request) / g.tokens_per_page)
            needed[g.name] = max(0, total - held)
        return needed

    def can_allocate(self, request_id: str, new_total_tokens: int) -> bool:
        """True when the pool has enough free pages for `allocate_slots` to succeed now (all
        groups together: they compete for the same pages). Raises as `blocks_needed`."""
        return sum(self.blocks_needed(request_id, new_total_tokens).values()) <= self.pool.num_free

    def num_slots(self, request_id: str) -> int:
        """Positions covered by the request's tables in every group (0 for unknown requests)."""
        if request_id not in self._tables:
            return 0
        tables = self._tables[request_id]
        return min(len(tables[g.name].blocks) * g.tokens_per_page for g in self.groups)

    def block_table(self, request_id: str, group: str) -> list[int]:
        """A copy of the request's block table in `group` (NULL_BLOCK at placeholders).

        Raises:
          KeyError: unknown request or group.
        """
        return list(self._tables[request_id][group].blocks)

    def table(self, request_id: str, group: str) -> BlockTable:
        """The live `BlockTable` record (read-only by convention). Raises KeyError."""
        return self._tables[request_id][group]

    def slot_mapping(self, request_id: str, group: str, positions: np.ndarray) -> np.ndarray:
        """Slots of logical `positions` in `group`: `table[p // tpp] * tpp + p % tpp`, int32.

        Placeholder entries map to -1 (no entry). Released entries map to their (still
        readable) slot; write only to owned pages.

        Raises:
          KeyError: unknown request or group.
          ValueError: a position < 0 or beyond the table's coverage.
        """
        tpp = self._spec[group].tokens_per_page
        blocks = np.asarray(self._tables[request_id][group].blocks, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= blocks.size * tpp):
            raise ValueError(
                f"positions must be in [0, {blocks.size * tpp}) for request {request_id!r} "
                f"group {group!r}"
            )
        page_blocks = blocks[pos // tpp]
        slots = page_blocks * tpp + pos % tpp
        return np.where(page_blocks == NULL_BLOCK, -1, slots).astype(np.int32)

    def block_table_array(
        self, request_ids: Sequence[str | None], group: str, width: int
    ) -> np.ndarray:
        """Block tables of `request_ids` in `group` as an int32 array [B, width], padded with
        NULL_BLOCK (0). A None id gives an all-null padding row.

        Raises:
          KeyError: unknown request or group.
          ValueError: a table longer than width.
        """
        out = np.zeros((len(request_ids), width), dtype=np.int32)
        for row, rid in enumerate(request_ids):
            if rid is None:
                continue
            blocks = self._tables[rid][group].blocks
            if len(blocks) > width:
                raise ValueError(
                    f"request {rid!r} holds {len(blocks)} pages in group {group!r}, width {width}"
                )
            out[row, : len(blocks)] = blocks
        return out

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request_id: str,
        new_total_tokens: int,
        cached_blocks: Mapping[str, Sequence[int]] | None = None,
        copy_from: Mapping[str, int] | None = None,
        loads: Mapping[str, Mapping[int, int]] | None = None,
    ) -> bool:
        """Append pages to every group's table so that `new_total_tokens` positions fit.

        cached_blocks: for a request without tables only, the leading pages per group to share
            (prefix-cache hits): each gets one more reference (a free one is revived out of the
            free queue, contents intact) and is placed at the head of the table, read-only by
            convention (only positions past them are written). A NULL_BLOCK entry becomes a
            placeholder (a page whose KV is not on the device: HiSparse's host tier).
        copy_from: for a request without tables only, per group, a page whose contents the
            request's first new page in that group must start from (copy-on-write of a page that
            a prefix-cache hit covers only in part; the request then writes the positions past
            the hit). A held source is copied: a fresh page is allocated and the copy
            `(source, new page)` is queued for the device (`take_page_copies`), to run before the
            step's forward pass; the source is never written. A free source (nobody else reads
            it) is taken over in place instead (`BlockPool.claim`: its tag is dropped through
            `on_reuse`, so it is no longer published), and no copy is needed.
        loads: for a request without tables only, per group, page index → host block of the
            offloading connector: the page gets a fresh device page filled from that host block
            (`(host block, page)` queued for `take_page_loads`, to run before the step). An index
            below `len(cached_blocks[g])` replaces that cached entry (which must be NULL_BLOCK);
            the index `len(cached_blocks[g])` is the request's first new page (a page the hit
            covers only in part whose source is on the host).

        All or nothing: returns False (changing nothing) when the pool lacks free pages for all
        groups together, counting the cached pages that must leave the free queue. A request
        seen for the first time gets (possibly empty) tables.

        Raises:
          ValueError: as `blocks_needed`; cached_blocks or copy_from for a request that already
            has tables or naming an unknown group; copy_from naming the null block or a group that
            gets no new page.
        """
        cached = {g.name: list(map(int, (cached_blocks or {}).get(g.name, ()))) for g in self.groups}
        copies = {name: int(b) for name, b in (copy_from or {}).items()}
        loads = {name: {int(i): int(b) for i, b in pages.items()} for name, pages in (loads or {}).items() if pages}
        for name, pages in loads.items():
            if name not in self._spec:
                raise ValueError(f"loads names unknown group {name!r}")
            for i in pages:
                if i > len(cached[name]) or (i < len(cached[name]) and cached[name][i] != NULL_BLOCK):
                    raise ValueError(f"loads page {i} of group {name!r} is not a NULL_BLOCK entry of the hit "
                                     "nor its first new page")
                if i == len(cached[name]) and name in copies:
                    raise ValueError(f"group {name!r} has both a copy_from and a load for its first new page")
        if cached_blocks or copies or loads:
            if request_id in self._tables:
                raise ValueError(f"cached_blocks or copy_from given for {request_id!r}, which already has tables")
            unknown = (set(cached_blocks or {}) | set(copies)) - set(self._spec)
            if unknown:
                raise ValueError(f"cached_blocks or copy_from names unknown groups {sorted(unknown)}")
            if NULL_BLOCK in copies.values():
                raise ValueError("copy_from must not name the null block")
            for b in copies.values():
                self.pool.refcount(b)  # range check
        base = self.blocks_needed(request_id, new_total_tokens)
        needed = {g.name: max(0, base[g.name] - len(cached[g.name])) for g in self.groups}
        for name in copies:
            if needed[name] == 0:
                raise ValueError(f"copy_from names group {name!r}, which gets no new page")
        inner = {name: [i for i in pages if i < len(cached[name])] for name, pages in loads.items()}
        for name, pages in loads.items():
            if len(cached[name]) in pages and needed[name] == 0:
                raise ValueError(f"loads names the first new page of group {name!r}, which gets no new page")
        needed_all = sum(needed.values()) + sum(len(v) for v in inner.values())
        revived = len({b for bs in cached.values() for b in bs if b != NULL_BLOCK and self.pool.is_free(b)})
        if needed_all + revived > self.pool.num_free:
            return False
        tables = self._tables.setdefault(request_id, {g.name: BlockTable() for g in self.groups})
        for g in self.groups:  # take every cached page out of the free queue before allocating
            if cached[g.name]:
                self.pool.incref(cached[g.name])  # ignores NULL_BLOCK
                t = tables[g.name]
                skip = set(inner.get(g.name, ()))
                t.placeholders.update(len(t.blocks) + i for i, b in enumerate(cached[g.name])
                                      if b == NULL_BLOCK and i not in skip)
                t.blocks.extend(cached[g.name])
        claimed: dict[str, int] = {}
        for name, src in copies.items():  # before allocating, which could hand a free source out
            if self.pool.is_free(src):
                self.pool.claim(src)
                claimed[name] = src
        for g in self.groups:
            n = needed[g.name]
            t = tables[g.name]
            for i in inner.get(g.name, ()):  # pages of the hit that come back from the host
                t.blocks[i] = self.pool.allocate(1)[0]
                self._page_loads.append((loads[g.name][i], t.blocks[i]))
            if g.name in claimed:
                t.blocks.append(claimed[g.name])
                n -= 1
            if n:
                new = self.pool.allocate(n)
                if g.name in copies and g.name not in claimed:
                    self._page_copies.append((copies[g.name], new[0]))
                if len(cached[g.name]) in loads.get(g.name, {}):
                    self._page_loads.append((loads[g.name][len(cached[g.name])], new[0]))
                t.blocks.extend(new)
        return True

    def take_page_loads(self) -> list[tuple[int, int]]:
        """The `(host block, device page)` loads queued by `allocate_slots(loads=)` since the last
        call; clears the queue. Run them before the step they were made for (the destinations are
        fresh pages of the admitted requests)."""
        out, self._page_loads = self._page_loads, []
        return out

    def take_page_copies(self) -> list[tuple[int, int]]:
        """The `(source, destination)` page copies queued by `allocate_slots` since the last
        call; clears the queue. Sources were held when queued and destinations were free, so no
        page is both a source and a destination until the pool reuses a source: run the copies
        (in any order) before any page is freed again, i.e. in the step they were made for."""
        out, self._page_copies = self._page_copies, []
        return out

    def free(self, request_id: str, front_groups: Sequence[str] = ()) -> None:
        """Return every owned page of the request to the pool and forget its tables.

        Each group's pages are freed last page first, so the pool reuses the tail of a sequence
        before its head. Pages of `front_groups` join the pool's front tier (`BlockPool.free(
        front=True)`: reused before other cached pages). Released pages that are still intact lose
        their tag (nobody will revive them; a page released by its sharers together keeps it while
        another sharer holds it released). Unknown ids are a no-op.
        """
        tables = self._tables.pop(request_id, None)
        if tables is None:
            return
        to_free: list[int] = []
        to_front: list[int] = []
        for g in self.groups:
            t = tables[g.name]
            out = to_front if g.name in front_groups else to_free
            for i in range(len(t.blocks) - 1, -1, -1):
                if t.is_owned(i):
                    out.append(t.blocks[i])
                elif i in t.released and self._released_intact(t, i):
                    tag = t.released[i]
                    if isinstance(tag, SharedReleaseTag):  # the others may still revive it
                        tag.sharers.pop(request_id, None)
                        if tag.sharers:
                            continue
                    self.pool.clear_tag(t.blocks[i])
        self.pool.free(to_free)
        self.pool.free(to_front, front=True)

    # ------------------------------------------------------------------ residency hooks

    def append_placeholders(self, request_id: str, group: str, n: int) -> None:
        """Append `n` placeholder (NULL_BLOCK) entries to the request's table in `group`
        (positions whose KV is not on the device, e.g. a host-only prefix).

        Raises:
          KeyError: unknown group. ValueError: n < 0 or the cap would be exceeded.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        spec = self._spec[group]
        tables = self._tables.setdefault(request_id, {g.name: BlockTable() for g in self.groups})
        t = tables[spec.name]
        cap = self.max_blocks_per_request[group]
        if cap is not None and len(t.blocks) + n > cap:
            raise ValueError(f"group {group!r}: {len(t.blocks) + n} pages exceed cap {cap}")
        start = len(t.blocks)
        t.blocks.extend([NULL_BLOCK] * n)
        t.placeholders.update(range(start, start + n))

    def release_page(self, request_id: str, group: str, page_index: int, tag: Any = None,
                     front: bool = False) -> int:
        """Give the request's reference to an owned page back to the pool, keeping the block id
        in the table (readable until reused). The page is tagged (default: a `ReleasedPageTag`)
        so the pool's `on_reuse` callback reports its reuse; route it to `on_block_reuse`.
        Release pages tail-first when the pool should reuse the tail first; `front` puts the page
        in the pool's front tier (`BlockPool.free`). Returns the block id.

        Raises:
          KeyError: unknown request or group.
          ValueError: the entry is not owned, or the page is shared (refcount > 1).
        """
        t = self._tables[request_id][group]
        self._check_index(t, page_index)
        if not t.is_owned(page_index):
            raise ValueError(f"page {page_index} of {request_id!r}/{group} is not owned")
        block = t.blocks[page_index]
        if self.pool.refcount(block) != 1:
            raise ValueError(f"block {block} is shared; only sole-owner pages can be released")
        if tag is None:
            tag = ReleasedPageTag(request_id, group, page_index)
        self.pool.set_tag(block, tag)
        self.pool.free([block], front=front)
        t.released[page_index] = tag
        return block

    def release_shared_page(self, entries: Mapping[str, int], group: str, front: bool = False) -> int:
        """Give back every reference to one shared page at once: `entries` maps each holder's
        request id to its page index of that page, and must name all of its holders (the pool's
        refcount). The block ids stay in the tables, released under one `SharedReleaseTag`;
        `revive_page` by any sharer revives it for every sharer still holding it released, and
        the pool's reuse of the block marks it lost in every table (`on_block_reuse`). Returns
        the block id.

        Raises:
          KeyError: unknown request or group.
          ValueError: fewer than two entries, entries naming different blocks or an entry that is
            not owned, or holders outside `entries` (refcount ≠ len(entries)).
        """
        if len(entries) < 2:
            raise ValueError("a shared release needs at least two holders; use release_page")
        blocks = set()
        for rid, i in entries.items():
            t = self._tables[rid][group]
            self._check_index(t, i)
            if not t.is_owned(i):
                raise ValueError(f"page {i} of {rid!r}/{group} is not owned")
            blocks.add(t.blocks[i])
        if len(blocks) != 1:
            raise ValueError(f"the entries name different blocks {sorted(blocks)}")
        block = blocks.pop()
        if self.pool.refcount(block) != len(entries):
            raise ValueError(f"block {block} has {self.pool.refcount(block)} holders, "
                             f"but {len(entries)} entries were given")
        tag = SharedReleaseTag(group, dict(entries))
        self.pool.set_tag(block, tag)
        self.pool.free([block] * len(entries), front=front)
        for rid, i in entries.items():
            self._tables[rid][group].released[i] = tag
        return block

    def revive_page(self, request_id: str, group: str, page_index: int) -> bool:
        """Take back a released page if the pool has not reused it (returns True; the entry is
        owned again and the page's tag cleared; a page released by its sharers together is taken
        back by every sharer still holding it released). If it was reused, the entry becomes a
        placeholder and this returns False.

        Raises:
          KeyError: unknown request or group. ValueError: the entry is not released.
        """
        t = self._tables[request_id][group]
        if page_index not in t.released:
            raise ValueError(f"page {page_index} of {request_id!r}/{group} is not released")
        if self._released_intact(t, page_index):
            block = t.blocks[page_index]
            tag = t.released[page_index]
            holders = tag.sharers if isinstance(tag, SharedReleaseTag) else {request_id: page_index}
            self.pool.incref([block] * len(holders))
            self.pool.clear_tag(block)
            for rid, i in holders.items():
                del self._tables[rid][group].released[i]
            return True
        self.mark_lost(request_id, group, page_index)
        return False

    def mark_lost(self, request_id: str, group: str, page_index: int) -> None:
        """Turn a released entry into a placeholder (its page was reused).

        Raises:
          KeyError: unknown request or group. ValueError: the entry is not released.
        """
        t = self._tables[request_id][group]
        if page_index not in t.released:
            raise ValueError(f"page {page_index} of {request_id!r}/{group} is not released")
        tag = t.released.pop(page_index)
        if isinstance(tag, SharedReleaseTag):
            tag.sharers.pop(request_id, None)
        t.blocks[page_index] = NULL_BLOCK
        t.placeholders.add(page_index)

    def on_block_reuse(self, block: int, tag: Any) -> bool:
        """A `BlockPool.on_reuse` handler: marks the released entry named by a `ReleasedPageTag`
        (every entry a `SharedReleaseTag` names) as lost. Returns True when the tag was one of this manager's, False otherwise (so a
        policy can chain handlers)."""
        if isinstance(tag, SharedReleaseTag):
            for rid, i in list(tag.sharers.items()):
                t = self._tables.get(rid, {}).get(tag.group)
                if t is not None and t.released.get(i) is tag and t.blocks[i] == block:
                    self.mark_lost(rid, tag.group, i)
            return True
        if not isinstance(tag, ReleasedPageTag):
            return False
        t = self._tables.get(tag.request_id, {}).get(tag.group)
        if t is None or t.released.get(tag.page_index) != tag or t.blocks[tag.page_index] != block:
            return False
        self.mark_lost(tag.request_id, tag.group, tag.page_index)
        return True

    # ------------------------------------------------------------------ checks

    def audit(self, external_refs: Mapping[int, int] | None = None) -> list[str]:
        """Check the tables against the pool; returns one string per violation.

        external_refs: references held outside request tables (block -> count), e.g. hot-buffer
            leases; without them every held page must belong to some table.

        Checked: pool.audit() is clean; every table respects its cap; NULL_BLOCK appears only at
        placeholders and placeholders hold NULL_BLOCK; released entries are still free in the pool
        with their tag (otherwise they should have been marked lost); every page's refcount equals
        the number of owned table entries naming it plus its external references (so no page is in
        two requests' tables unless it is refcounted as shared, and no held page is leaked).
        """
        errors = list(self.pool.audit())
        owners: Counter[int] = Counter()
        for rid, tables in self._tables.items():
            if set(tables) != set(self._spec):
                errors.append(f"request {rid!r} has tables for {sorted(tables)}")
                continue
            for g in self.groups:
                t = tables[g.name]
                where = f"request {rid!r} group {g.name!r}"
                cap = self.max_blocks_per_request[g.name]
                if cap is not None and len(t.blocks) > cap:
                    errors.append(f"{where}: {len(t.blocks)} pages exceed cap {cap}")
                if t.placeholders & set(t.released):
                    errors.append(f"{where}: entries both released and placeholder")
                for i in sorted(t.placeholders | set(t.released)):
                    if not 0 <= i < len(t.blocks):
                        errors.append(f"{where}: state recorded for missing page index {i}")
                for i, block in enumerate(t.blocks):
                    if not 0 <= block < self.pool.num_blocks:
                        errors.append(f"{where}: page {i} names out-of-range block {block}")
                        continue
                    if i in t.placeholders:
                        if block != NULL_BLOCK:
                            errors.append(f"{where}: placeholder page {i} names block {block}")
                    elif block == NULL_BLOCK:
                        errors.append(f"{where}: null block at page {i} without a placeholder")
                    elif i in t.released:
                        tag = t.released[i]
                        if isinstance(tag, SharedReleaseTag) and tag.sharers.get(rid) != i:
                            errors.append(f"{where}: released page {i} is missing from its shared tag")
                        if not self._released_intact(t, i):
                            errors.append(
                                f"{where}: released page {i} (block {block}) was reused but "
                                "not marked lost"
                            )
                    else:
                        owners[block] += 1
        for block, n in (external_refs or {}).items():
            owners[block] += n
        for block in range(1, self.pool.num_blocks):
            rc = self.pool.refcount(block)
            if rc != owners.get(block, 0):
                errors.append(
                    f"block {block}: refcount {rc} but {owners.get(block, 0)} owners "
                    "(leaked, double-owned or unshared reuse)"
                )
        return errors

    # ------------------------------------------------------------------ helpers

    def _released_intact(self, t: BlockTable, page_index: int) -> bool:
        block = t.blocks[page_index]
        return self.pool.is_free(block) and self.pool.get_tag(block) == t.released[page_index]

    @staticmethod
    def _check_index(t: BlockTable, page_index: int) -> None:
        if not 0 <= page_index < len(t.blocks):
            raise ValueError(f"page index {page_index} out of range [0, {len(t.blocks)})")
