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
page, so such a policy must first unpublish it (or chain both owners in one tag).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import numpy as np

from serving.block_pool import NULL_BLOCK
from serving.kv_cache import KVCacheManager
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
    """

    num_tokens: int
    blocks: dict[str, list[int]]
    copy_from: dict[str, int] = field(default_factory=dict)


class PrefixCache:
    """Maps prefix hashes to published pages, per KV cache group (see the module docstring).

    Args:
      kv: the block tables; the cache reads tables and tags pages of `kv.pool`.

    Route the pool's `on_reuse` callback to `on_block_reuse` (it returns False for tags that are
    not this cache's, so handlers can be chained).
    """

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.unit = reduce(math.gcd, [g.tokens_per_page for g in kv.groups])
        self._units_per_page = {g.name: g.tokens_per_page // self.unit for g in kv.groups}
        self._entries: dict[str, dict[bytes, int]] = {g.name: {} for g in kv.groups}
        self._pages: dict[int, _PublishedPage] = {}
        self.queries = 0
        self.hits = 0
        self.copies = 0

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
        """Longest usable cached prefix of the request's tokens (see `PrefixHit`). Changes
        nothing (no references taken)."""
        limit = (request.num_tokens - 1) // self.unit  # in units
        if limit == 0:
            return PrefixHit(0, {g.name: [] for g in self.kv.groups})
        hashes = self.block_hashes(request, limit * self.unit)
        best = limit
        found: dict[str, tuple[list[int], int | None]] = {}
        for g in self.kv.groups:
            k = self._units_per_page[g.name]
            entries = self._entries[g.name]
            full: list[int] = []
            while (len(full) + 1) * k <= best:
                block = entries.get(hashes[(len(full) + 1) * k - 1])
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
        for g in self.kv.groups:
            k = self._units_per_page[g.name]
            full, partial = found[g.name]
            n = best // k
            hit.blocks[g.name] = full[:n]
            if best % k:
                hit.copy_from[g.name] = full[n] if n < len(full) else partial
        return hit

    def record_query(self, num_query_tokens: int, hit: PrefixHit) -> None:
        """Count one admission's lookup (tokens queried, tokens hit, pages made copy-on-write)."""
        self.queries += num_query_tokens
        self.hits += hit.num_tokens
        self.copies += len(hit.copy_from)

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
        units = request.num_computed_tokens // self.unit
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
        request.num_published_units = units

    def on_block_reuse(self, block: int, tag: Any) -> bool:
        """A `BlockPool.on_reuse` handler: the pool handed out a published page, so all its keys
        are evicted. Returns True when the tag was this cache's."""
        if not isinstance(tag, CachedPageTag):
            return False
        page = self._pages.get(block)
        if page is not None and page.tag == tag:
            self._drop(block)
        return True

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
        return errors
