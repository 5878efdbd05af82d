"""Prefix caching over the shared block pool (`--enable-prefix-caching`, vLLM v1 semantics).

Hashes. A request's tokens are cut into hash units of `unit` tokens (the gcd of the groups'
tokens-per-page; 64 for GLM-5.3). Unit `i` gets the chained hash
`h_i = blake2b(h_{i-1} || int64 tokens of unit i)` (h_{-1} = a fixed seed), so `h_i` names the
whole prefix `tokens[: (i + 1) * unit]`, not only its last unit. Only full units are hashed.

Pages. A page of group `g` covers `k_g = tokens_per_page_g / unit` units; once every position of
it has KV in the cache it is published under the key `(g, h_{(j + 1) k_g - 1})` (the hash of the
prefix that ends with the page). Publishing tags the page in the pool with a `CachedPageTag`; the
page stays owned by its request. When the last owner frees it, it enters the pool's LRU free queue
with its contents and tag intact; a later request whose prefix hashes to the same key takes it
back (`BlockPool.incref` revives it) and shares it read-only. When the pool hands the page out for
something else, `on_block_reuse` drops the entry (eviction = reuse of the least recently freed
unreferenced page; requests free their pages tail first, so a prefix's head is evicted last).
If two requests compute the same page at the same time, the first published copy wins and the
other stays private to its request.

Hits across groups. A hit must be usable in every group: a request that reuses `H` tokens writes
its own KV from position `H` on, so position `H` must start a fresh page in every group — a shared
page is never written. The hit length is therefore the longest prefix found in every group
(the minimum over groups of each group's run of cached pages), rounded down to a multiple of
`align` = lcm of the tokens-per-page of all groups, and at most `num_tokens - 1` (the last token is
always recomputed, its logits are needed to sample). With the tiny checkpoint (mla 64 tokens per
page, indexer 768) hits come in steps of 768 tokens; on GLM-5.3 in steps of the indexer page.
A finer grain would need a copy-on-write of the partial indexer page, which this does not do.

Counters (`queries`, `hits`) count tokens, as vLLM's `prefix_cache_queries/hits` do.

A page carries one pool tag. A policy that releases a published page with a tag of its own
(HiSparse `KVCacheManager.release_page`) replaces the `CachedPageTag`; `audit` reports such a
page, so such a policy must first unpublish it (or chain both owners in one tag).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
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
    """The pool tag of a published page: its group and the hash of the prefix it ends."""

    group: str
    block_hash: bytes


class PrefixCache:
    """Maps prefix hashes to published pages, per KV cache group (see the module docstring).

    Args:
      kv: the block tables; the cache reads tables and tags pages of `kv.pool`.

    Route the pool's `on_reuse` callback to `on_block_reuse` (it returns False for tags that are
    not this cache's, so handlers can be chained).
    """

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        tpps = [g.tokens_per_page for g in kv.groups]
        self.unit = reduce(math.gcd, tpps)
        self.align = reduce(lambda a, b: a * b // math.gcd(a, b), tpps)
        self._units_per_page = {g.name: g.tokens_per_page // self.unit for g in kv.groups}
        self._entries: dict[str, dict[bytes, int]] = {g.name: {} for g in kv.groups}
        self._block_key: dict[int, CachedPageTag] = {}
        self.queries = 0
        self.hits = 0

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

    def lookup(self, request: Request) -> tuple[int, dict[str, list[int]]]:
        """Longest usable cached prefix of the request's tokens.

        Returns `(num_tokens, blocks)`: the hit length (a multiple of `align`, < num_tokens)
        and, per group, the pages covering it in order. Changes nothing (no references taken).
        """
        limit = (request.num_tokens - 1) // self.align * self.align
        if limit == 0:
            return 0, {g.name: [] for g in self.kv.groups}
        hashes = self.block_hashes(request, limit)
        hit = limit
        found: dict[str, list[int]] = {}
        for g in self.kv.groups:
            k = self._units_per_page[g.name]
            entries = self._entries[g.name]
            pages: list[int] = []
            while (len(pages) + 1) * g.tokens_per_page <= hit:
                block = entries.get(hashes[(len(pages) + 1) * k - 1])
                if block is None:
                    break
                pages.append(block)
            found[g.name] = pages
            hit = min(hit, len(pages) * g.tokens_per_page)
        hit = hit // self.align * self.align
        return hit, {g.name: found[g.name][: hit // g.tokens_per_page] for g in self.kv.groups}

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (tokens queried, tokens hit)."""
        self.queries += num_query_tokens
        self.hits += num_hit_tokens

    # ------------------------------------------------------------------ publishing

    def cache_full_pages(self, request: Request) -> None:
        """Publish the request's pages whose positions all have KV (below num_computed_tokens)
        and that are not published yet. Pages already published under the same key by another
        request are left private."""
        rid = request.request_id
        if not self.kv.has_request(rid):
            return
        computed = request.num_computed_tokens
        hashes = self.block_hashes(request, computed)
        pool = self.kv.pool
        for g in self.kv.groups:
            k = self._units_per_page[g.name]
            table = self.kv.table(rid, g.name)
            done = request.num_published_pages.get(g.name, 0)
            full = min(computed // g.tokens_per_page, len(table.blocks))
            entries = self._entries[g.name]
            for j in range(done, full):
                if not table.is_owned(j):
                    continue
                block = table.blocks[j]
                if block in self._block_key:
                    continue  # a hit page, or already published
                key = hashes[(j + 1) * k - 1]
                if key in entries:
                    continue
                tag = CachedPageTag(g.name, key)
                entries[key] = block
                self._block_key[block] = tag
                pool.set_tag(block, tag)
            request.num_published_pages[g.name] = max(done, full)

    def on_block_reuse(self, block: int, tag: Any) -> bool:
        """A `BlockPool.on_reuse` handler: the pool handed out a published page, so its entry is
        evicted. Returns True when the tag was this cache's."""
        if not isinstance(tag, CachedPageTag):
            return False
        if self._block_key.get(block) == tag:
            del self._block_key[block]
            del self._entries[tag.group][tag.block_hash]
        return True

    def reset(self) -> int:
        """Forget every entry whose page is free (unreferenced); returns how many. Pages in use
        stay published."""
        pool = self.kv.pool
        dropped = 0
        for block, tag in list(self._block_key.items()):
            if pool.is_free(block):
                pool.clear_tag(block)
                del self._block_key[block]
                del self._entries[tag.group][tag.block_hash]
                dropped += 1
        return dropped

    @property
    def num_entries(self) -> int:
        """Published pages (in use or free)."""
        return len(self._block_key)

    # ------------------------------------------------------------------ checks

    def audit(self) -> list[str]:
        """One string per violation: every entry names a non-null in-range page whose pool tag is
        the entry's own `CachedPageTag`, and the two indexes agree."""
        errors: list[str] = []
        pool = self.kv.pool
        n = 0
        for group, entries in self._entries.items():
            for key, block in entries.items():
                n += 1
                tag = CachedPageTag(group, key)
                if not 0 < block < pool.num_blocks or block == NULL_BLOCK:
                    errors.append(f"prefix cache entry of group {group!r} names block {block}")
                    continue
                if self._block_key.get(block) != tag:
                    errors.append(f"prefix cache indexes disagree on block {block}")
                if pool.get_tag(block) != tag:
                    errors.append(f"block {block} is published but carries tag {pool.get_tag(block)!r}")
        if n != len(self._block_key):
            errors.append(f"prefix cache has {n} entries but {len(self._block_key)} published blocks")
        return errors
