"""How Hybrid HiSparse makes room on the device: releasing clean MLA pages of running requests,
giving them back when the pressure is gone (`HiSparsePolicy`'s share of docs/hisparse.md "Policy").

* Each request's own pages first: `_candidates` lists, for every running request not protected
  (scheduled this step with several query rows), its clean, sole-owned pages below its two newest,
  with the gain net of the decode lease it must take if it holds none; `_release_all` releases
  them tail first into the pool's front tier.
* Then pages several running requests share (prefix-cache hits): `_shared_candidates` groups the
  clean pages that a set of sharers holds together and nobody else holds; releasing them from all
  sharers at once (`KVCacheManager.release_shared_page`) gains the pages less a decode lease for
  each sharer without one. Only `_make_room(shared=True)` uses them (a running request that would
  otherwise be preempted; admission too when `shared_release_admits`).
* `_revive`: with no pressure, mixed requests whose released pages are all intact take them back
  and return their leases.

`PageReleaseMixin` holds these methods; `HiSparsePolicy` (serving/hisparse/residency.py) provides
the state they use: `kv`, `group`, `records`, `running`, `dec_pages`, `watermark`,
`prefix_cache`, `releasable`, `clean_pages`, and the counters `num_released`, `num_released_shared`,
`num_revived`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.request import Request


class PageReleaseMixin:
    """Releasing and reviving HiSparse pages (module docstring); mixed into `HiSparsePolicy`."""

    def _release_all(self, req: "Request", pages: list[int]) -> None:
        """Release `pages`, tail first, into the pool's front tier (reused after untagged pages and
        before cached ones: host-backed pages are the cheapest to lose), so the pool reuses a
        request's tail first and a prompt's head stays resident longest."""
        rid = req.request_id
        for i in sorted(pages, reverse=True):
            block = self.kv.table(rid, self.group).blocks[i]
            if self.prefix_cache is not None:
                self.prefix_cache.unpublish_block(block)
            self.kv.release_page(rid, self.group, i, front=True)
        self.num_released += len(pages)

    def _release_shared(self, sharers: list["Request"], pages: list[dict[str, int]], cost: int) -> None:
        """Release pages that `sharers` hold together (each `{sharer: page index}` names every
        holder of one page), tail first into the front tier, then give each sharer without a
        lease a lease of `cost` pages (`_shared_candidates` counted it)."""
        pool = self.kv.pool
        for e in sorted(pages, key=lambda e: -max(e.values())):
            rid, i = next(iter(e.items()))
            block = self.kv.table(rid, self.group).blocks[i]
            if self.prefix_cache is not None:
                self.prefix_cache.unpublish_block(block)
            self.kv.release_shared_page(e, self.group, front=True)
        self.num_released_shared += len(pages)
        for req in sharers:
            rec = self.records[req.request_id]
            if not rec.lease:
                rec.lease = pool.allocate(cost)

    def _candidates(self, protect: set[str], cost: int | None = None) -> list[tuple[int, "Request", list[int]]]:
        """(pages gained, request, releasable pages) of the running requests not in `protect`
        that would gain pages by releasing (net of the lease of `cost` pages, default
        `dec_pages`, they must take), most first."""
        cost = self.dec_pages if cost is None else cost
        cands = []
        for req in self.running:
            rec = self.records.get(req.request_id)
            if req.request_id in protect or rec is None:
                continue
            rel = self.releasable(req)
            gain = len(rel) - (0 if rec.lease else cost)
            if gain > 0:
                cands.append((gain, req, rel))
        cands.sort(key=lambda c: -c[0])
        return cands

    def _shared_candidates(self, protect: set[str], leased: set[str],
                           cost: int | None = None) -> list[tuple[int, list["Request"], list[dict[str, int]]]]:
        """(pages gained, sharers, per page {sharer: page index}) for each set of running requests
        not in `protect` that share clean pages nobody else holds (prefix-cache hits): releasing
        those pages from every sharer together frees them, less a lease of `cost` pages (default
        `dec_pages`) for each sharer not in `leased` (holding one or about to take one). Greedy,
        most gain first (a lease taken for one set is not paid again by the next); positive gains
        only."""
        cost = self.dec_pages if cost is None else cost
        pool = self.kv.pool
        entries: dict[int, dict[str, int]] = {}  # shared block → {sharer: page index}
        by_id: dict[str, "Request"] = {}
        for req in self.running:
            rid = req.request_id
            if rid in protect:
                continue
            by_id[rid] = req
            for i, b in self.clean_pages(req):
                if pool.refcount(b) > 1:
                    entries.setdefault(b, {})[rid] = i
        sets: dict[frozenset, list[dict[str, int]]] = {}
        for b, e in entries.items():
            if len(e) == pool.refcount(b):  # every holder is a running request that may release it
                sets.setdefault(frozenset(e), []).append(e)
        out = []
        leased = set(leased)
        while sets:
            sharers, pages = max(sets.items(), key=lambda kv_: len(kv_[1]) - cost * len(kv_[0] - leased))
            gain = len(pages) - cost * len(sharers - leased)
            if gain <= 0:
                break
            out.append((gain, [by_id[r] for r in sorted(sharers)], pages))
            leased |= sharers
            del sets[sharers]
        return out

    def _leased_after(self, cands: list[tuple[int, "Request", list[int]]]) -> set[str]:
        """Requests holding a lease once `cands` (from `_candidates`) have released."""
        return {rid for rid, rec in self.records.items() if rec.lease} | {c[1].request_id for c in cands}

    def _room(self, protect: set[str], shared: bool = False, lease_pages: int | None = None) -> int:
        """Free pages plus what the running requests not in `protect` could release (their own
        clean pages; with `shared`, also clean pages they share, `_shared_candidates`), net of
        leases of `lease_pages` (default `dec_pages`)."""
        cands = self._candidates(protect, lease_pages)
        room = self.kv.pool.num_free + sum(c[0] for c in cands)
        if shared:
            room += sum(c[0] for c in self._shared_candidates(protect, self._leased_after(cands), lease_pages))
        return room

    def _make_room(self, needed: int, protect: set[str], shared: bool = False, lease_pages: int | None = None) -> bool:
        """Release clean pages of running requests (not `protect`) until `needed` pages are free:
        each request's own pages first, then pages several of them share, from all the sharers
        together; a releasing request without a lease takes one of `lease_pages` (default
        `dec_pages`; `least_pages` when squeezing, `HiSparsePolicy._squeeze`). Releases nothing
        (and returns False) when even releasing everything would not do."""
        pool = self.kv.pool
        if pool.num_free >= needed:
            return True
        cost = self.dec_pages if lease_pages is None else lease_pages
        cands = self._candidates(protect, cost)
        own = pool.num_free + sum(c[0] for c in cands)
        if own < needed and not (shared and own + sum(
                c[0] for c in self._shared_candidates(protect, self._leased_after(cands), cost)) >= needed):
            return False
        for _, req, rel in cands:
            rec = self.records[req.request_id]
            self._release_all(req, rel)
            if not rec.lease:
                rec.lease = pool.allocate(cost)
            if pool.num_free >= needed:
                return True
        for _, sharers, pages in (self._shared_candidates(protect, self._leased_after([]), cost) if shared else ()):
            self._release_shared(sharers, pages, cost)
            if pool.num_free >= needed:
                return True
        return pool.num_free >= needed

    def _revive(self) -> None:
        """No pressure: mixed requests whose released pages are all intact take them back."""
        pool = self.kv.pool
        for req in self.running:
            rid = req.request_id
            rec = self.records.get(rid)
            if rec is None or not rec.lease or not self.kv.has_request(rid):
                continue
            t = self.kv.table(rid, self.group)
            if t.placeholders:
                continue
            if not t.released:  # a sharer revived the pages it shared with this request
                pool.free(reversed(rec.lease))
                rec.lease = []
                continue
            if pool.num_free - len(t.released) + len(rec.lease) < 2 * self.watermark:
                return
            for i in sorted(t.released):
                self.kv.revive_page(rid, self.group, i)
            pool.free(reversed(rec.lease))
            rec.lease = []
            self.num_revived += 1
