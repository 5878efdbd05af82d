"""Prefix caching over the shared block pool (`--enable-prefix-caching`, vLLM v1 semantics).

Hashes. A request's tokens are cut into hash units of `unit` tokens (the gcd of the groups'
tokens-per-page; 64 for GLM-5.3, the MLA page). Unit `i` gets the chained hash
`h_i = blake2b(h_{i-1} || int64 tokens of unit i)` (h_{-1} = a fixed seed), so `h_i` names the
whole prefix `tokens[: (i + 1) * unit]`, not only its last unit. Only full units are hashed.

Pages. A page of group `g` covers `k_g = tokens_per_page_g / unit` units. As soon as a unit's
positions all have KV in the cache, the page of each group that holds it is published under the
key `(g, h_unit)`: the entry promises that the page's rows from the page start up to the end of
that unit hold the KV of the prefix `h_unit` names. A page is therefore published under several
keys while its owner fills it (one per unit), and those rows never change while the entry lives:
the owner writes only positions past what it has computed, and nobody else writes a page it does
not own alone. Publishing tags the page in the pool with a `CachedPageTag`; the page stays owned
by its request. When the last owner frees it, it enters the pool's LRU free queue with its
contents and tag intact; a later request takes it back (`BlockPool.incref` revives it). When the
pool hands the page out for something else, `on_block_reuse` drops all of its keys (eviction =
reuse of the least recently freed unreferenced page; requests free their pages tail first, so a
prefix's head is evicted last). If two requests compute the same unit, the first published page
keeps the key.

Hits. A request that reuses `H` tokens (a multiple of `unit`, at most `num_tokens - 1`: the last
token is always recomputed, its logits are needed to sample) writes its own KV from position `H`
on. In every group, the pages wholly below `H` are shared read-only (one more reference). When
`H` falls inside a page of a group (its pages hold more than one unit, like the indexer group's
768 tokens on the tiny checkpoint), that page is copy-on-write: the request gets a page of its own
starting from the cached page's contents (`KVCacheManager.allocate_slots(copy_from=...)`; a copy
on the device before the step's forward pass, or the page itself when nobody else holds it).
Rows of the copy past `H` are stale, but the request overwrites them before any of its queries can
see them: readers only see positions <= the query's own position (the indexer masks `s > pos`,
sparse MLA reads only the selected positions). `H` is the longest prefix, in units, that every
group covers (full pages found by the key of their last unit, then the partial page found by the
key of the furthest unit in it), so hits come at 64-token granularity in every group.

Counters (`queries`, `hits`) count tokens, as vLLM's `prefix_cache_queries/hits` do; `copies`
counts pages made copy-on-write (device copies and pages taken over in place).

A page carries one pool tag. A policy that releases a published page with a tag of its own
(HiSparse `KVCacheManager.release_page`) replaces the `CachedPageTag`; `audit` reports such a
page, so such a policy first unpublishes it (`unpublish_block`).

Host tier (Hybrid HiSparse, docs/design.md §6.1). With a `host_pool` (the HiSparse host pool's block
pool), pages of the `host_group` (the MLA latent group; its pages must be one hash unit long) are
also published in host memory: `publish_host` files a host block under the unit's key once its
copy is complete, tags it in the host pool, and the host pool's reuse callback
(`on_host_block_reuse`) drops it. A lookup then covers a `host_group` page by a device page or by
a host block: `PrefixHit.blocks` holds the device page or NULL_BLOCK (the request starts that
page as a placeholder, HiSparse state "none" or "mixed", and reads its rows through the hot
buffer) and `PrefixHit.host_blocks` every host block found (so an adopted device page whose host
copy exists is clean at once). The other groups still need device pages, so a hit is as long as
the shortest coverage.

Offload tier (the KV offloading connector, `serving/offload/`). With an `offload` store, full pages
of the groups it manages are also stored to host memory as soon as they are full
(`cache_computed_units` queues the stores; the store files them under the key of their last unit
once copied). A lookup that finds no device page for a key of such a group takes the host copy:
`PrefixHit.blocks` holds NULL_BLOCK there and `PrefixHit.loads` the host block; the request gets a
fresh device page loaded from it before its first step (`KVCacheManager.allocate_slots(loads=)`),
so unlike the HiSparse tier the request runs fully resident. The hit's tokens from the first
loaded page on are external hits (`external_hits`, vLLM's `external_prefix_cache_hits`), the ones
before it local (`hits`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import numpy as np

from serving.block_pool import NULL_BLOCK, BlockPool
from serving.kv_cache import KVCacheManager
from serving.kv_events.coverage import UnitCoverage
from serving.kv_events.tracker import KVEventTracker
from serving.prompt_logprobs import wants_prompt_logprobs
from serving.request import Request

_ROOT_HASH = b"glm53-prefix-cache-v1"


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Hash of a unit given its parent's hash: blake2b-128 of parent || int64 little-endian ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


@dataclass(frozen=True)
class CachedPageTag:
    """The pool tag of a published page: its group and the first key it was published under."""

    group: str
    block_hash: bytes


@dataclass
class _PublishedPage:
    tag: CachedPageTag
    keys: list[bytes]


@dataclass
class PrefixHit:
    """The result of `PrefixCache.lookup`.

    num_tokens: the hit length H (a multiple of the hash unit, < the request's token count).
    blocks: per group, the pages wholly below H, in order (shared read-only).
    copy_from: per group whose page at H is only partly covered, the cached page to start the
        request's own page from (copy-on-write); absent for groups whose pages end at H.
    host_blocks: host tier only: page index → host block of the host group's pages below H that
        have a host copy (NULL_BLOCK in `blocks` where there is no device page).
    loads: offload tier only: per group, page index → host block of the pages that come back
        from the connector's host store (NULL_BLOCK in `blocks` below H; an index equal to
        `len(blocks[g])` is the page H ends inside, whose copy-on-write source is then the host
        block). `load_keys` has the keys they are filed under.
    """

    num_tokens: int
    blocks: dict[str, list[int]]
    copy_from: dict[str, int] = field(default_factory=dict)
    host_blocks: dict[int, int] = field(default_factory=dict)
    loads: dict[str, dict[int, int]] = field(default_factory=dict)
    load_keys: dict[str, dict[int, bytes]] = field(default_factory=dict)
    num_local_tokens: int | None = None

    @property
    def num_load_pages(self) -> int:
        """Fresh device pages the loads need beyond the ones `blocks` leaves for new tokens: one per
        loaded page below the hit (the page H ends inside is the request's first new page)."""
        return sum(1 for g, pages in self.loads.items() for i in pages if i < len(self.blocks.get(g, ())))

    @property
    def num_external_tokens(self) -> int:
        """Tokens of the hit from the first page that comes back from the offload tier on (vLLM's
        external prefix-cache hit); the tokens before it are the device-local hit."""
        return 0 if self.num_local_tokens is None else self.num_tokens - self.num_local_tokens


class PrefixCache:
    """Maps prefix hashes to published pages, per KV cache group (see the module docstring).

    Args:
      kv: the block tables; the cache reads tables and tags pages of `kv.pool`.

    Route the pool's `on_reuse` callback to `on_block_reuse` (it returns False for tags that are
    not this cache's, so handlers can be chained).

    host_pool: optional host tier (module docstring): the HiSparse host pool's `BlockPool`, whose
      `on_reuse` must be routed to `on_host_block_reuse`. host_group: the group it holds.

    Raises ValueError when the host group's pages are not one hash unit long.
    """

    def __init__(self, kv: KVCacheManager, host_pool: BlockPool | None = None, host_group: str = "mla",
                 offload=None):
        self.kv = kv
        self.offload = offload  # serving.offload.OffloadStore: the connector's tier, or None
        self.unit = reduce(math.gcd, [g.tokens_per_page for g in kv.groups])
        self._units_per_page = {g.name: g.tokens_per_page // self.unit for g in kv.groups}
        self._entries: dict[str, dict[bytes, int]] = {g.name: {} for g in kv.groups}
        self._pages: dict[int, _PublishedPage] = {}
        self.host_pool = host_pool
        self.host_group = host_group
        if host_pool is not None and self._units_per_page.get(host_group) != 1:
            raise ValueError(f"the host tier needs {host_group!r} pages of one hash unit ({self.unit} tokens)")
        self._host_entries: dict[bytes, int] = {}
        self._host_keys: dict[int, CachedPageTag] = {}  # host block -> its tag (one key per block)
        self.queries = 0
        self.hits = 0
        self.copies = 0
        self.host_hits = 0  # hit tokens whose host-group page came from the host tier only
        self.external_queries = 0  # tokens looked up with the offload tier on (vLLM's external_*)
        self.external_hits = 0  # hit tokens from the first page loaded from the offload tier on
        self.coverage: UnitCoverage | None = None  # per-unit media for KV events (track_events), or None

    # ------------------------------------------------------------------ hashing

    def block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """The chained hashes of the full units among the first `num_tokens` tokens of the
        request (extends `request.block_hashes` as needed and returns it)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * self.unit <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(chain_hash(parent, tokens[i * self.unit : (i + 1) * self.unit]))
        return hashes

    # ------------------------------------------------------------------ lookup

    def lookup(self, request: Request) -> PrefixHit:
        """Longest usable cached prefix of the request's tokens (see `PrefixHit`); none for a
        request that still wants its prompt logprobs (`serving.prompt_logprobs`). Changes
        nothing (no references taken)."""
        limit = (request.num_tokens - 1) // self.unit  # in units
        if wants_prompt_logprobs(request):  # its prompt positions must be computed (vLLM skips reading too)
            limit = 0
        if limit == 0:
            return PrefixHit(0, {g.name: [] for g in self.kv.groups})
        hashes = self.block_hashes(request, limit * self.unit)
        best = limit
        found: dict[str, tuple[list[int], int | None]] = {}
        host_found: dict[int, int] = {}
        load_found: dict[str, dict[int, tuple[int, bytes]]] = {}
        off = self.offload
        for g in self.kv.groups:
            k = self._units_per_page[g.name]
            entries = self._entries[g.name]
            tier = self.host_pool is not None and g.name == self.host_group
            offloaded = off is not None and g.name in off.groups
            loads = load_found[g.name] = {}
            full: list[int] = []
            while (len(full) + 1) * k <= best:
                key = hashes[(len(full) + 1) * k - 1]
                block = entries.get(key)
                if tier and key in self._host_entries:
                    host_found[len(full)] = self._host_entries[key]
                    block = NULL_BLOCK if block is None else block
                if block is None and offloaded:
                    hb = off.lookup(g.name, key)
                    if hb is not None:  # the device lost it; the offload store has it
                        loads[len(full)] = (hb, key)
                        block = NULL_BLOCK
                if block is None:
                    break
                full.append(block)
            cover = len(full) * k
            partial = None
            for u in range(min(cover + k, best) - 1, cover - 1, -1):  # furthest unit of the next page
                block = entries.get(hashes[u])
                if block is not None:
                    partial, cover = block, u + 1
                    break
            found[g.name] = (full, partial)
            best = min(best, cover)
            if best == 0:
                return PrefixHit(0, {g.name: [] for g in self.kv.groups})
        hit = PrefixHit(best * self.unit, {})
        local = hit.num_tokens
        for g in self.kv.groups:
            k = self._units_per_page[g.name]
            full, partial = found[g.name]
            n = best // k
            hit.blocks[g.name] = full[:n]
            loads = {i: v for i, v in load_found[g.name].items() if i < n or (i == n and best % k)}
            if best % k and n not in loads:  # (else the page H ends inside comes back from the host)
                hit.copy_from[g.name] = full[n] if n < len(full) else partial
            if loads:
                hit.loads[g.name] = {i: hb for i, (hb, _) in loads.items()}
                hit.load_keys[g.name] = {i: key for i, (_, key) in loads.items()}
                local = min(local, min(loads) * self.kv.group(g.name).tokens_per_page)
        hit.host_blocks = {i: b for i, b in host_found.items() if i < best}
        if off is not None:
            hit.num_local_tokens = local
        return hit

    def record_query(self, num_query_tokens: int, hit: PrefixHit) -> None:
        """Count one admission's lookup (tokens queried, tokens hit, pages made copy-on-write)."""
        self.queries += num_query_tokens
        self.hits += hit.num_tokens - hit.num_external_tokens
        self.copies += len(hit.copy_from)
        if self.offload is not None:
            self.external_queries += num_query_tokens
            self.external_hits += hit.num_external_tokens
        if self.host_pool is not None:
            self.host_hits += self.unit * sum(1 for b in hit.blocks.get(self.host_group, []) if b == NULL_BLOCK)

    # ------------------------------------------------------------------ publishing

    def cache_computed_units(self, request: Request) -> None:
        """Publish, for every unit whose positions all have KV now (below num_computed_tokens)
        and that was not offered yet, the request's page holding it in every group. A key that
        another page holds already stays with that page; released or placeholder entries are
        skipped."""
        rid = request.request_id
        if not self.kv.has_request(rid):
            return
        done = request.num_published_units
        # Asynchronous scheduling counts positions of steps in flight, whose tokens may not be known.
        units = min(request.num_computed_tokens, request.num_tokens) // self.unit
        if units <= done:
            return
        hashes = self.block_hashes(request, units * self.unit)
        pool = self.kv.pool
        for g in self.kv.groups:
            k = self._units_per_page[g.name]
            table = self.kv.table(rid, g.name)
            entries = self._entries[g.name]
            for u in range(done, min(units, len(table.blocks) * k)):
                j = u // k
                if not table.is_owned(j):
                    continue
                key = hashes[u]
                if key in entries:
                    continue
                block = table.blocks[j]
                page = self._pages.get(block)
                if page is None:
                    page = self._pages[block] = _PublishedPage(CachedPageTag(g.name, key), [])
                    pool.set_tag(block, page.tag)
                page.keys.append(key)
                entries[key] = block
                if self.coverage is not None:
                    self.coverage.extend(g.name, block, hashes, j * k, u, request.all_token_ids)
        if self.offload is not None:
            self._queue_offload_stores(request, hashes, done, units)
        request.num_published_units = units

    def _queue_offload_stores(self, request: Request, hashes: list[bytes], done: int, units: int) -> None:
        """Queue the connector's stores of the pages that became full (their last unit now below
        `units`, not below `done`) in the groups it manages."""
        off = self.offload
        for g in self.kv.groups:
            if g.name not in off.groups:
                continue
            k = self._units_per_page[g.name]
            table = self.kv.table(request.request_id, g.name)
            for j in range(done // k, min(units // k, len(table.blocks))):
                if (j + 1) * k <= done or table.blocks[j] == NULL_BLOCK or j in table.placeholders:
                    continue
                key = hashes[(j + 1) * k - 1]
                if off.queue_store(g.name, key, table.blocks[j]) and self.coverage is not None:
                    self.coverage.offload_queued(g.name, key, hashes[j * k : (j + 1) * k])

    def adopt_loads(self, hit: PrefixHit) -> None:
        """An admitted hit's loads are planned: pin their host blocks until the step ran
        (`OffloadStore.unpin`)."""
        if self.offload is not None:
            self.offload.pin([hb for pages in hit.loads.values() for hb in pages.values()])

    def on_block_reuse(self, block: int, tag: Any) -> bool:
        """A `BlockPool.on_reuse` handler: the pool handed out a published page, so all its keys
        are evicted. Returns True when the tag was this cache's."""
        if not isinstance(tag, CachedPageTag):
            return False
        page = self._pages.get(block)
        if page is not None and page.tag == tag:
            self._drop(block)
        return True

    def hit_intact(self, hit: PrefixHit) -> bool:
        """True while every page a `lookup` result names is still published (nothing handed one
        of its free pages out since), so it can still be adopted."""
        for name, blocks in hit.blocks.items():
            for b in blocks:
                if b != NULL_BLOCK and (b not in self._pages or self._pages[b].tag.group != name):
                    return False
        if any(b not in self._pages for b in hit.copy_from.values()):
            return False
        for g, pages in hit.loads.items():
            if not all(self.offload.is_filed(g, hit.load_keys[g][i], hb) for i, hb in pages.items()):
                return False
        return all(b in self._host_keys for b in hit.host_blocks.values())

    def unpublish_block(self, block: int) -> bool:
        """Drop every key of a published device page and clear its tag (a policy is about to put
        a tag of its own on it). Returns True when the page was published."""
        page = self._pages.get(block)
        if page is None:
            return False
        if self.kv.pool.get_tag(block) == page.tag:
            self.kv.pool.clear_tag(block)
        self._drop(block)
        return True

    # ------------------------------------------------------------------ host tier

    def publish_host(self, key: bytes, host_block: int) -> bool:
        """File `host_block` (whose copy is complete) under the unit hash `key` of the host group,
        unless the key is filed already; tags the block in the host pool. Returns True when
        filed. Raises ValueError without a host tier or for a block filed under another key."""
        if self.host_pool is None:
            raise ValueError("this prefix cache has no host tier")
        if key in self._host_entries:
            return False
        if host_block in self._host_keys:
            if self._host_keys[host_block].block_hash == key:
                return False
            raise ValueError(f"host block {host_block} is filed under another key")
        tag = CachedPageTag("host:" + self.host_group, key)
        self.host_pool.set_tag(host_block, tag)
        self._host_entries[key] = host_block
        self._host_keys[host_block] = tag
        if self.coverage is not None:
            self.coverage.host_filed(key)
        return True

    def host_key(self, host_block: int) -> bytes | None:
        """The key a host block is filed under, or None."""
        tag = self._host_keys.get(host_block)
        return None if tag is None else tag.block_hash

    def on_host_block_reuse(self, block: int, tag: Any) -> bool:
        """The host pool's `on_reuse` handler: a filed host block was handed out again, so its key
        is dropped. Returns True when the tag was this cache's."""
        if not isinstance(tag, CachedPageTag) or self._host_keys.get(block) != tag:
            return False
        del self._host_keys[block]
        del self._host_entries[tag.block_hash]
        if self.coverage is not None:
            self.coverage.host_dropped(tag.block_hash)
        return True

    @property
    def num_host_entries(self) -> int:
        """Host blocks filed in the host tier."""
        return len(self._host_entries)

    def reset(self) -> int:
        """Forget every page that is free (unreferenced); returns how many. Pages in use stay
        published."""
        pool = self.kv.pool
        free = [b for b in self._pages if pool.is_free(b)]
        for block in free:
            pool.clear_tag(block)
            self._drop(block)
        return len(free)

    @property
    def num_entries(self) -> int:
        """Published pages (in use or free)."""
        return len(self._pages)

    @property
    def num_keys(self) -> int:
        """Published (group, unit hash) keys."""
        return sum(len(e) for e in self._entries.values())

    def _drop(self, block: int) -> None:
        page = self._pages.pop(block)
        entries = self._entries[page.tag.group]
        for key in page.keys:
            del entries[key]
        if self.coverage is not None:
            self.coverage.drop(block)

    # ------------------------------------------------------------------ KV events

    def track_events(self) -> KVEventTracker:
        """Start tracking which media hold each unit (`serving.kv_events.coverage`) and return the
        event tracker (block size = the hash unit). Pages published before the call are not
        reported."""
        if self.coverage is None:
            host = self.host_group if self.host_pool is not None else None
            off = self.offload.groups if self.offload is not None else ()
            self.coverage = UnitCoverage(self.unit, [g.name for g in self.kv.groups], host, off)
            if self.offload is not None:
                self.offload.listener = self.coverage
        return self.coverage.tracker

    # ------------------------------------------------------------------ checks

    def audit(self) -> list[str]:
        """One string per violation: every key names a non-null in-range page that lists the
        key, and whose pool tag is the page's own `CachedPageTag`; every published page's keys
        name it; no key is listed twice."""
        errors: list[str] = []
        pool = self.kv.pool
        for group, entries in self._entries.items():
            for key, block in entries.items():
                if not 0 < block < pool.num_blocks or block == NULL_BLOCK:
                    errors.append(f"prefix cache entry of group {group!r} names block {block}")
                    continue
                page = self._pages.get(block)
                if page is None or page.tag.group != group or key not in page.keys:
                    errors.append(f"prefix cache indexes disagree on block {block}")
        n = 0
        for block, page in self._pages.items():
            n += len(page.keys)
            if pool.get_tag(block) != page.tag:
                errors.append(f"block {block} is published but carries tag {pool.get_tag(block)!r}")
            if len(set(page.keys)) != len(page.keys):
                errors.append(f"block {block} lists a key twice")
            for key in page.keys:
                if self._entries[page.tag.group].get(key) != block:
                    errors.append(f"block {block} lists a key that names another page")
        if n != self.num_keys:
            errors.append(f"prefix cache has {self.num_keys} keys but its pages list {n}")
        if self.host_pool is not None:
            if len(self._host_keys) != len(self._host_entries):
                errors.append("host tier indexes disagree in size")
            for key, block in self._host_entries.items():
                tag = self._host_keys.get(block)
                if tag is None or tag.block_hash != key:
                    errors.append(f"host tier key of host block {block} disagrees")
                elif self.host_pool.get_tag(block) != tag:
                    errors.append(f"host block {block} is filed but carries tag {self.host_pool.get_tag(block)!r}")
        return errors
