"""Hybrid HiSparse residency policy over the one device pool (docs/design.md §6.1).

Pages of the MLA group (`mla`: the sparse-MLA latent rows of every layer) move through

    dirty ──copy complete──▶ clean ──release──▶ released ──pool reuses the block──▶ lost

* dirty: on the device only (being written, or sealed with its host copy queued / in flight);
* clean: on the device and in the host pool (the copy finished in an earlier step);
* released: the request gave the block back to the pool (`KVCacheManager.release_page`); its rows
  stay readable in place until the pool hands the block out again;
* lost: the pool reused the block; the table entry is a null placeholder and the page's rows are
  read from the host pool through the request's hot buffer.

The two newest pages of a request (the page holding its last computed position and the one
before) are never released. The indexer keys (and every other group) stay on the device.

A request is *full* when none of its MLA pages is released or lost, *none* when every page
before its two newest is lost (nothing of its history on the device: a new request reusing a
host-only prefix, say), *mixed* otherwise. Mixed and none requests hold a *hot lease*: ordinary pages of the same pool whose rows
are hot slots indexed by token row (`kernels/hot_resolve`).

Pressure. When fewer than `watermark` pages are free (max(a decode lease, `watermark` × the
pool)), and whenever an allocation would fail, running requests release clean pages: the requests
with the most releasable pages first, each releasing all of them, taking a decode lease if it has
none. Released pages join the pool's front tier (`BlockPool.free(front=True)`): reused after
pages nobody cares about and before cached pages (they are backed by host copies; a cached indexer
page is not), a request's tail before its head (a prompt's head stays resident longest). A
finished request's MLA pages likewise join the front tier, its indexer pages the ordinary cached
tier, so a later turn of the conversation finds its indexer prefix still on the device. A request
already scheduled in the step with several query rows is never released (its hot lease was sized
for its current residency). A page several running requests share (a prefix-cache hit) is released
by none of them alone; when their own pages do not make room, the clean pages a set of sharers hold
together (and nobody else holds) are released from all of them at once
(`KVCacheManager.release_shared_page`), each sharer without a lease taking a decode lease: a set
is released only when its pages outnumber the leases it costs. When a running request would
still be preempted, leases are *squeezed* (`_squeeze`): the same releases with each new lease at
`least_pages` ((num_speculative_tokens + 1) × index_topk rows: all that a decode step's rows can
miss at once) instead of `dec_pages`, and the leases of running requests not scheduled with more
rows than that cut to `least_pages`; the request itself takes a step its squeezed lease covers.
A squeezed lease grows back to `dec_pages` at the first step with free pages for it (fewer hot
slots meanwhile: more misses, never a wrong row). Preemption (recompute) stays the last resort,
when even squeezing cannot make room (e.g. the host pool is full, so nothing is clean). When
pressure is gone (free pages ≥ 2 × watermark), a mixed request whose released pages are all still
intact revives them and returns its lease (mixed → full).

Hot lease sizing. A decoding request leases `device_buffer_size` rows (default (spec + 2) ×
index_topk). A step with R query rows of a request with off-device pages needs R × index_topk hot
slots, or every off-device row if fewer (each distinct missed row takes one slot, and the
resolver gives a miss no slot it cannot evict): the lease is
max(device_buffer_size, min(R × K, off-device rows)), at most `prefill_buffer_size`; if the
off-device rows exceed that, R is capped at prefill_buffer_size // K (the worst-case prefill chunk
bound, `prefill_sizing: "worst_case"`).

Adaptive prefill sizing (`prefill_sizing: "adaptive"`, the default). R × K is a bound on the
distinct rows a chunk selects, not what it selects: adjacent queries pick heavily overlapping
rows, and the resolver deduplicates them, so a chunk of many more rows usually fits the lease.
A request prefilling with pages off the device gets `prefill_rows` query rows (its own estimate,
never below the worst-case bound). If its selections overflow the lease, the resolver drops the
last misses in first-occurrence order, so every query row before the first one with a dropped
selection was fully resolved: the step reports that position (`HotState.first_drop_S`), the
engine keeps the chunk up to it and recomputes the rest next step
(`serving.hisparse.truncation`); the estimate becomes the rows that fitted. A chunk that fits
whole raises the estimate by an eighth (at least one row): adjacent chunks select alike, so the
estimate settles just under what fits, and few rows are computed twice. A step that keeps no row
(possible when hits of later rows pin the whole lease) is followed by a worst-case-sized one, so
every request progresses.

Lease growth (`prefill_buffer_max_size` > `prefill_buffer_size`; off by default). A larger lease
takes more query rows a step, so a long prefill beyond the pool needs fewer steps. When the
prefilling request is the only running request and none waits, its lease may take, up to
`grow_pages`, the free pages past the watermark and its step's token pages and its own clean
pages (released first: their rows are read through the lease like any off-device row); the lease
is sized again every step, so the pages go back at the next step once another request runs or
waits. Admission and the planner count `max_pages` only (grown pages are pages nothing else
wanted).

Admission needs room for the request fully resident (its prompt's pages in every group, plus a hot
lease when its prefix starts on the host) plus a page of headroom per running request (at most
`watermark` in all), counting the pages running requests can release: so the running set settles
at 1 + ⌊(pool − first) / (steady + 1)⌋ requests (`glm53/capacity/`
`predict_hisparse_requests` with `reserve_per_request=1`). A waiting request whose prefix-cache
hit covers at least half of it (the next turn of a conversation) may be admitted past a head that
does not fit (`admission_lookahead`). A request that could not be fully resident even in an empty pool (a
context longer than the device pool) is admitted with an in-flight window instead: the pages of its
first chunk (and a lease); it then allocates chunk by chunk, and its own earlier chunks become clean
and are released as the prefill proceeds, so later chunks read them through the hot buffer. The
window costs about two chunks of MLA pages (the chunk, and the previous chunk whose copy is in
flight), two tail pages, the indexer pages of the whole context and the lease.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np

from serving.block_pool import NULL_BLOCK
from serving.hisparse.admission_bound import AdmissionBoundMixin
from serving.hisparse.config import ResolvedHiSparse
from serving.hisparse.host_pool import CopyJob, HostPool
from serving.hisparse.release import PageReleaseMixin
from serving.kv_cache import KVCacheManager
from serving.kv_policy import DeviceResidentPolicy

if TYPE_CHECKING:
    from serving.prefix_cache import PrefixCache, PrefixHit
    from serving.request import Request
    from serving.scheduler_output import SchedulerOutput

RESIDENCY_STATES = ("full", "mixed", "none")


@dataclass(eq=False)
class RequestResidency:
    """HiSparse state of one running request.

    host_blocks: MLA page index → host block holding (or receiving) its copy (one reference each).
    pending: page indices whose copy is not complete yet (queued or in flight): dirty.
    lease: the hot pages (device blocks, one reference each), in slot order.
    seen_lease: the lease the device-side hot state was last resolved against (None: stale, e.g.
        a new state row), to tell the step which hot slots are stale.
    next_seal: the first page index not yet considered for a copy.
    prefill_rows: adaptive prefill sizing's estimate of the query rows a chunk of this request can
        have with pages off the device (0: not yet estimated; module docstring).
    """

    host_blocks: dict[int, int] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    lease: list[int] = field(default_factory=list)
    seen_lease: list[int] | None = None
    next_seal: int = 0
    prefill_rows: int = 0


class HiSparsePolicy(PageReleaseMixin, AdmissionBoundMixin, DeviceResidentPolicy):
    """Hybrid HiSparse over `kv`'s pool (see the module docstring).

    Args:
      kv: the block tables; the `group` (default "mla") is the HiSparse-managed group.
      host: the host pool's bookkeeping.
      config: the resolved `hisparse_config`.
      index_topk: K of the model's indexer.
      prefix_cache: optional; its host tier gets the completed copies.
      hot_tpp: hot slots a leased page gives each device (default: the group's tokens per page).
        Under DCP an engine page of `g · N` tokens is a `g`-row page on every rank, and any rank may
        own a whole top-k, so leases are sized in per-rank rows: `hot_tpp = g`.
    """

    name = "hisparse"
    # A continuation whose prefix lives in the host tier is cheap to admit (placeholders, a lease
    # and its new tokens), and waiting behind a large first turn would cost it the indexer pages
    # its hit needs: let up to this many pass a head that does not fit (`serving/scheduler.py`).
    admission_lookahead = 8
    # Pages several running requests share are released (from all of them together) to save a
    # running request from preemption; releasing them to admit a waiting request as well runs
    # more requests at once but makes every sharer read those pages through its hot buffer
    # (docs/hisparse.md "Shared pages are released by all their sharers together": on the CPU
    # probe 0 instead of 1 preemption, 6.8 instead of 6.2 running, 1.26x the host-to-device
    # bytes), so it is off.
    shared_release_admits = False

    def __init__(self, kv: KVCacheManager, host: HostPool, config: ResolvedHiSparse, index_topk: int,
                 prefix_cache: "PrefixCache | None" = None, group: str = "mla", hot_tpp: int | None = None):
        super().__init__(kv)
        self.host = host
        self.config = config
        self.group = group
        self.tpp = kv.group(group).tokens_per_page
        self.K = index_topk
        self.prefix_cache = prefix_cache
        self.hot_tpp = hot_tpp or self.tpp
        self.dec_pages = config.device_buffer_rows // self.hot_tpp
        # The lease a request is squeezed to instead of a preemption (module docstring).
        self.least_pages = min(self.dec_pages, -(-(config.least_decode_rows or config.device_buffer_rows) // self.hot_tpp))
        self.max_pages = config.prefill_hot_rows // self.hot_tpp  # the lease a prefill is sure of
        self.grow_pages = config.max_hot_rows // self.hot_tpp  # ... and grows to in free pages (module docstring)
        usable = kv.pool.num_usable_blocks
        self.watermark = min(usable, max(self.dec_pages, math.ceil(config.config.watermark * usable)))
        self.records: dict[str, RequestResidency] = {}
        self.running: list["Request"] = []
        self.waiting: Iterable["Request"] = ()
        self.num_grown_steps = 0  # steps a prefill lease held pages past prefill_buffer_size
        self._rows: dict[str, int] = {}  # query rows each request got in the step being built
        self.num_released = 0  # pages released so far by their one holder
        self.num_released_shared = 0  # pages released by all their sharers together
        self.num_revived = 0
        self.num_squeezed_steps = 0  # steps a request ran with a lease below dec_pages (squeezed)
        self.num_landed_host = 0  # P/D requests admitted with their MLA pages in the host pool
        self.adaptive = config.config.prefill_sizing == "adaptive"
        self.num_truncated_chunks = 0  # prefill chunks kept only up to their first dropped selection
        self.num_truncated_rows = 0  # query rows of those chunks computed again

    # ------------------------------------------------------------------ queries
    def _rec(self, req: "Request") -> RequestResidency:
        return self.records.setdefault(req.request_id, RequestResidency())

    def off_pages(self, rid: str) -> int:
        """MLA pages of the request that are released or lost (placeholders)."""
        t = self.kv.table(rid, self.group)
        return len(t.released) + len(t.placeholders)

    def residency(self, req: "Request") -> str:
        """"full", "mixed" or "none" (module docstring)."""
        rid = req.request_id
        if not self.kv.has_request(rid) or self.off_pages(rid) == 0:
            return "full"
        t = self.kv.table(rid, self.group)
        newest = max(0, (req.num_computed_tokens - 1) // self.tpp)
        history = range(min(len(t.blocks), max(0, newest - 1)))
        return "none" if history and all(i in t.placeholders for i in history) else "mixed"

    def residency_counts(self) -> dict[str, int]:
        """Running requests per residency state."""
        out = dict.fromkeys(RESIDENCY_STATES, 0)
        for req in self.running:
            out[self.residency(req)] += 1
        return out

    def clean_pages(self, req: "Request") -> list[tuple[int, int]]:
        """(page index, block) of the owned, clean MLA pages of `req` below its two newest: the
        pages it may give back (alone when sole-owned, `releasable`; with every sharer when
        shared, `_shared_candidates`)."""
        rid = req.request_id
        rec = self.records.get(rid)
        if rec is None or not self.kv.has_request(rid):
            return []
        t = self.kv.table(rid, self.group)
        newest = (req.num_computed_tokens - 1) // self.tpp
        return [(i, t.blocks[i]) for i in range(min(len(t.blocks), max(0, newest - 1)))
                if t.is_owned(i) and i in rec.host_blocks and i not in rec.pending]

    def releasable(self, req: "Request") -> list[int]:
        """Clean, sole-owned MLA page indices of `req` that may be released (not the two newest)."""
        pool = self.kv.pool
        return [i for i, b in self.clean_pages(req) if pool.refcount(b) == 1]

    # ------------------------------------------------------------------ lease sizing
    def _hot_rows_needed(self, rows: int, off: int) -> int:
        """Hot slots a step of `rows` query rows of a request with `off` off-device pages can need
        at once: every row may miss its whole top-k, but each distinct missed row takes one slot,
        so never more than the off-device rows (module docstring, "Hot lease sizing")."""
        return min(rows * self.K, off * self.hot_tpp)

    def _lease_pages(self, rid: str, rows: int, off: int | None = None, cap: int | None = None,
                     floor: int | None = None) -> int:
        """Hot pages a step of `rows` query rows needs (0 for a full request), at most `cap`
        (default `max_pages`), at least `floor` (default `dec_pages`; `least_pages` when
        squeezed)."""
        off = self.off_pages(rid) if off is None else off
        if off == 0:
            return 0
        need_rows = self._hot_rows_needed(rows, off)
        return max(self.dec_pages if floor is None else floor,
                   min(self.max_pages if cap is None else cap, math.ceil(need_rows / self.hot_tpp)))

    def _token_pages(self, req: "Request", num_new: int) -> int:
        """Pages (every group) `req` allocates to compute `num_new` more tokens."""
        return sum(self.kv.blocks_needed(req.request_id, req.num_computed_tokens + num_new).values())

    def _lease_cap(self, req: "Request", num_new: int, tok: int | None = None) -> int:
        """The most lease pages `req` may hold in a step of `num_new` tokens (`tok` token pages,
        default computed): `max_pages`, or up to `grow_pages` when it is the only running request
        and none waits — the free pages and its own clean pages past the watermark and the step's
        token pages (module docstring, "Lease growth")."""
        if self.grow_pages <= self.max_pages or self.waiting or len(self.running) != 1 or self.running[0] is not req:
            return self.max_pages
        rec = self.records.get(req.request_id)
        have = len(rec.lease) if rec else 0
        tok = self._token_pages(req, num_new) if tok is None else tok
        room = self.kv.pool.num_free + have + len(self.releasable(req)) - tok - self.watermark
        return max(self.max_pages, min(self.grow_pages, room))

    def _sure_rows(self, cap_pages: int | None = None) -> int:
        """Query rows whose selections always fit a lease of `cap_pages` (default `max_pages`):
        the worst-case bound."""
        return max(1, (self.max_pages if cap_pages is None else cap_pages) * self.hot_tpp // self.K)

    def _cap_rows(self, rows: int, off: int, rec: RequestResidency | None = None, cap_pages: int | None = None) -> int:
        cap = (self.max_pages if cap_pages is None else cap_pages) * self.hot_tpp
        if off == 0 or rows * self.K <= cap or off * self.hot_tpp <= cap:
            return rows
        sure = self._sure_rows(cap_pages)
        if not self.adaptive:
            return min(rows, sure)
        guess = rec.prefill_rows if rec is not None and rec.prefill_rows else 4 * sure
        return min(rows, max(sure, guess))

    def cap_new_tokens(self, req: "Request", num_new: int) -> int:
        """The HiSparse prefill chunk bound (module docstring)."""
        if num_new <= 0 or not self.kv.has_request(req.request_id):
            return num_new
        return self._cap_rows(num_new, self.off_pages(req.request_id), self.records.get(req.request_id),
                              self._lease_cap(req, num_new))

    def observe_step(self, kept: dict[str, int], rows: dict[str, int] | None = None) -> int:
        """Adaptive prefill sizing, after the step this policy scheduled ran: `kept` maps the
        requests whose chunk was truncated to the query rows that were valid. Updates the estimate
        of every request that resolved several rows through its lease (module docstring).
        rows: the query rows per request of the observed step (`step_rows()` when it was
        scheduled); default: the step scheduled last (synchronous scheduling).
        Returns the query rows to compute again (the truncated chunks' rows past their cut)."""
        sure = self._sure_rows()
        recomputed = 0
        for rid, rows in (self._rows if rows is None else rows).items():
            rec = self.records.get(rid)
            if rec is None:
                continue
            if rid in kept:
                self.num_truncated_chunks += 1
                recomputed += rows - kept[rid]
                rec.prefill_rows = max(sure, kept[rid])
            elif rec.lease and rows >= max(sure, rec.prefill_rows):
                rec.prefill_rows = rows + max(1, rows // 8)
        self.num_truncated_rows += recomputed
        return recomputed

    # ------------------------------------------------------------------ scheduling hooks
    def begin_step(self, running: list["Request"], waiting: Iterable["Request"] = ()) -> None:
        self.running = running
        self.waiting = waiting
        self._rows = {}
        pool = self.kv.pool
        if pool.num_free < self.watermark:
            self._make_room(self.watermark, protect=set())
        elif pool.num_free >= 2 * self.watermark:
            self._revive()

    def _protected(self, scheduled: Iterable["Request"], exclude: str | None = None,
                   lease_pages: int | None = None) -> set[str]:
        """Requests already scheduled this step with more query rows than a lease of `lease_pages`
        (default `dec_pages`) always covers (their leases were sized for their current residency)."""
        rows = (self.dec_pages if lease_pages is None else lease_pages) * self.hot_tpp
        return {r.request_id for r in scheduled
                if r.request_id != exclude and self._rows.get(r.request_id, 0) * self.K > rows}

    def _pages_needed(self, req: "Request", num_new: int, floor: int | None = None, lookahead: int = 0) -> int:
        rid = req.request_id
        rec = self.records.get(rid)
        have = len(rec.lease) if rec else 0
        return self._token_pages(req, num_new + lookahead) + max(0, self._lease_pages(rid, num_new, floor=floor) - have)

    def _try_allocate(self, req: "Request", num_new: int, floor: int | None = None, lookahead: int = 0) -> bool:
        """Token pages for `num_new` query rows and `lookahead` positions past them, and the lease
        the rows need (sized by the rows alone) → False when the pool cannot hold them (nothing
        changed)."""
        rid = req.request_id
        rec = self._rec(req)
        tok = self._token_pages(req, num_new + lookahead)
        want = self._lease_pages(rid, num_new, cap=self._lease_cap(req, num_new, tok), floor=floor)
        if want > self.max_pages and tok + want - len(rec.lease) + self.watermark > self.kv.pool.num_free:
            # A grown lease takes the request's own clean pages too (`_lease_cap` counted them).
            self._make_room(tok + want - len(rec.lease) + self.watermark, protect=set())
        if tok + max(0, want - len(rec.lease)) > self.kv.pool.num_free:
            return False
        if want < len(rec.lease):
            self.kv.pool.free(reversed(rec.lease[want:]))
            del rec.lease[want:]
        ok = self.kv.allocate_slots(rid, req.num_computed_tokens + num_new + lookahead)
        assert ok, "allocation checked above"
        if want > len(rec.lease):
            rec.lease += self.kv.pool.allocate(want - len(rec.lease))
        if 0 < want < self.dec_pages:
            self.num_squeezed_steps += 1
        if want > self.max_pages:
            self.num_grown_steps += 1
        self._rows[rid] = num_new
        return True

    def allocate(self, req: "Request", num_new: int, scheduled: Iterable["Request"], lookahead: int = 0) -> int:
        """`DeviceResidentPolicy.allocate` under pressure: releases clean pages of running requests,
        then shrinks the chunk to what the decode lease covers, then squeezes leases (`_squeeze`),
        before it returns 0 (a preemption). The chunk bounds and the lease count query rows
        (`num_new`); `lookahead` positions only take token pages."""
        scheduled = list(scheduled)
        for _ in range(3):  # releasing this request's own pages can change its chunk bound
            n = self.cap_new_tokens(req, num_new)
            if self._try_allocate(req, n, lookahead=lookahead):
                return n
            if not self._make_room(self._pages_needed(req, n, lookahead=lookahead),
                                   self._protected(scheduled, req.request_id), shared=True):
                break
        n = self.cap_new_tokens(req, num_new)
        if self._try_allocate(req, n, lookahead=lookahead):
            return n
        # A mixed request's chunk can shrink to what the decode lease covers.
        small = max(1, min(n, self.dec_pages * self.hot_tpp // self.K))
        if small < n and self._try_allocate(req, small, lookahead=lookahead):
            return small
        return self._squeeze(req, small, scheduled, lookahead)

    def _squeeze(self, req: "Request", num_new: int, scheduled: list["Request"], lookahead: int = 0) -> int:
        """The last resort before a preemption: `num_new` (cut to what a lease of `least_pages`
        covers) with every lease this step gives or keeps at `least_pages` instead of
        `dec_pages` — the request's own, and those of the requests releasing pages for it (own
        pages, or pages several of them share). Returns the tokens allocated, 0 when even that
        does not make room."""
        fl = self.least_pages
        if fl >= self.dec_pages:
            return 0
        n = max(1, min(num_new, fl * self.hot_tpp // self.K))
        if self._try_allocate(req, n, floor=fl, lookahead=lookahead):
            return n
        protect = self._protected(scheduled, req.request_id, lease_pages=fl)
        needed = self._pages_needed(req, n, floor=fl, lookahead=lookahead)
        cuts = sorted(((len(self.records[r.request_id].lease) - fl, r) for r in self.running
                       if r is not req and r.request_id not in protect and r.request_id in self.records
                       and len(self.records[r.request_id].lease) > fl), key=lambda c: -c[0])
        if self._room(protect, shared=True, lease_pages=fl) + sum(c for c, _ in cuts) < needed:
            return 0  # nothing changed: the scheduler preempts
        for _, r in cuts:
            if self._room(protect, shared=True, lease_pages=fl) >= needed:
                break
            rec = self.records[r.request_id]
            self.kv.pool.free(reversed(rec.lease[fl:]))
            del rec.lease[fl:]
        if (self._make_room(needed, protect, shared=True, lease_pages=fl)
                and self._try_allocate(req, n, floor=fl, lookahead=lookahead)):
            return n
        return 0

    def admit(self, req: "Request", hit: "PrefixHit | None", num_new: int, scheduled: Iterable["Request"]) -> int:
        rid = req.request_id
        protect = self._protected(scheduled)
        cached = dict(hit.blocks) if hit is not None else {}
        num_hit = hit.num_tokens if hit is not None else 0
        off = sum(1 for b in cached.get(self.group, []) if b == NULL_BLOCK)
        pool = self.kv.pool
        revived = len({b for bs in cached.values() for b in bs if b != NULL_BLOCK and pool.is_free(b)})
        loaded = hit.num_load_pages if hit is not None else 0  # pages coming back from the connector

        def need(total_tokens: int, rows: int) -> int:
            tok = sum(max(0, math.ceil(total_tokens / g.tokens_per_page) - len(cached.get(g.name, [])))
                      for g in self.kv.groups)
            return tok + revived + loaded + self._lease_pages(rid, rows, off)

        num_new = self._cap_rows(num_new, off)
        # Each running request keeps a page of headroom for its growth (a new tail page is
        # needed before the previous one's copy completes and it can be released), up to the
        # watermark in all.
        reserve = min(self.watermark, len(self.running))
        # A prefix that starts on the host is prefilled through the hot buffer: when the lease
        # its whole first chunk wants does not fit, a smaller chunk (down to what the decode lease
        # covers) gets it started.
        least = max(1, min(num_new, self.dec_pages * self.hot_tpp // self.K)) if off else num_new
        while num_new > least and need(req.num_tokens, num_new) + reserve > self._room(
                protect, shared=self.shared_release_admits):
            num_new = max(least, num_new // 2)
        full = need(req.num_tokens, num_new)
        if full <= pool.num_usable_blocks:  # fits fully resident: the admission rule
            target = req.num_tokens
            if not self._make_room(full + reserve, protect, shared=self.shared_release_admits):
                return 0
        else:  # longer than the device pool: an in-flight window of the first chunk
            while num_new > 1 and need(num_hit + num_new, num_new) > pool.num_usable_blocks:
                num_new = max(1, num_new // 2)
            target = num_hit + num_new
            if not self._make_room(need(target, num_new) + reserve, protect, shared=self.shared_release_admits):
                return 0
        if hit is not None and self.prefix_cache is not None and not self.prefix_cache.hit_intact(hit):
            return 0  # making room handed out a page of the hit; the next step looks it up again
        if not self.kv.allocate_slots(rid, target, hit and hit.blocks, hit and hit.copy_from, hit and hit.loads):
            return 0
        rec = self.records[rid] = RequestResidency()
        for i, b in (hit.host_blocks.items() if hit is not None else ()):
            self.host.blocks.incref([b])
            rec.host_blocks[i] = b
        rec.next_seal = 0
        lease = self._lease_pages(rid, num_new)
        if lease:
            rec.lease = pool.allocate(lease)
        self._rows[rid] = num_new
        return num_new

    def admit_remote(self, req: "Request", num_new: int, scheduled: Iterable["Request"]) -> tuple[int, dict]:
        """A request whose KV was pulled from a prefill engine (P/D). Device pages when the
        admission rule finds room for it fully resident (releasing clean pages of running
        requests as for any admission); else its whole MLA pages below its last computed token
        land straight in host blocks (the request starts with them as placeholders, in "none"
        residency, with a hot lease), and only its other groups' pages, its newest MLA pages and
        the lease take device pages. Returns (tokens it may compute, 0: not admitted; MLA page
        index → host block of the pages to fill in host memory)."""
        usable = self.kv.pool.num_usable_blocks
        full = sum(math.ceil(req.num_tokens / g.tokens_per_page) for g in self.kv.groups)
        if full <= usable:
            n = self.admit(req, None, num_new, scheduled)
            if n:
                return n, {}
        rid = req.request_id
        k = (req.num_tokens - num_new) // self.tpp  # whole MLA pages of the landed tokens
        if k < 1 or self.host.blocks.num_free < k:
            return 0, {}
        protect = self._protected(scheduled)
        pages = sum(math.ceil(req.num_tokens / g.tokens_per_page) - (k if g.name == self.group else 0)
                    for g in self.kv.groups)
        lease = self._lease_pages(rid, num_new, off=k)
        reserve = min(self.watermark, len(self.running))
        if pages + lease > usable or not self._make_room(pages + lease + reserve, protect):
            return 0, {}
        if not self.kv.allocate_slots(rid, req.num_tokens, {self.group: [NULL_BLOCK] * k}):
            return 0, {}
        rec = self.records[rid] = RequestResidency()
        for i in range(k):
            rec.host_blocks[i] = self.host.allocate()
        rec.next_seal = k
        rec.lease = self.kv.pool.allocate(lease)
        self._rows[rid] = num_new
        self.num_landed_host += 1
        return num_new, dict(rec.host_blocks)

    def lease_of(self, rid: str) -> list[int]:
        """The request's hot lease (device blocks), [] without one."""
        rec = self.records.get(rid)
        return list(rec.lease) if rec is not None else []

    def step_rows(self) -> dict[str, int]:
        """The query rows each request got in the step scheduled last (for `observe_step`)."""
        return dict(self._rows)

    def may_truncate(self, rid: str, num_rows: int) -> bool:
        """Whether a chunk of `num_rows` query rows of request `rid`, just dispatched on the hot
        program, can be cut at its first dropped selection (`serving.hisparse.truncation`): it
        resolves several rows through a hot lease that its rows' selections may overflow — more
        than the lease's rows in all (`num_rows` × index_topk, or every off-device row when
        fewer: each distinct missed row takes one slot). A decode step's rows (MTP verification
        rows included) and worst-case-sized prefill chunks always fit; adaptive prefill chunks
        may not (module docstring)."""
        rec = self.records.get(rid)
        if num_rows <= 1 or rec is None or not rec.lease:
            return False
        return self._hot_rows_needed(num_rows, self.off_pages(rid)) > len(rec.lease) * self.hot_tpp

    def after_update(self, out: "SchedulerOutput") -> None:
        self.complete_copies()
        for sr in out.scheduled:
            req = sr.request
            if req.request_id in self.records and self.kv.has_request(req.request_id):
                self._seal(req)

    def complete_copies(self) -> None:
        """The write-through copies in flight ran (or are ordered before every program that can
        read their host rows or reuse their device pages: asynchronous scheduling): their pages
        become clean and the prefix cache's host tier publishes them."""
        for job in self.host.complete():
            rec = job.owner
            if job.page_index in rec.pending and rec.host_blocks.get(job.page_index) == job.host_block:
                rec.pending.discard(job.page_index)
            if self.prefix_cache is not None and job.key is not None:
                self.prefix_cache.publish_host(job.key, job.host_block)
            self.host.release(job)

    def free(self, req: "Request", preempted: bool = False) -> None:
        rid = req.request_id
        rec = self.records.pop(rid, None)
        if rec is not None:
            if self.prefix_cache is not None and self.kv.has_request(rid):
                self._seal(req)  # the host tier keeps the prefix for later turns / the resume
            else:
                self.host.cancel(rec)
            if rec.lease:
                self.kv.pool.free(reversed(rec.lease))
            if rec.host_blocks:
                self.host.blocks.free(rec.host_blocks.values())
        # Its MLA pages are (or are about to be) backed by host copies: they are the ones to reuse
        # first; the indexer pages, which nothing backs, stay cached longer for a later turn.
        self.kv.free(rid, front_groups=(self.group,))

    # ------------------------------------------------------------------ mechanisms
    def _seal(self, req: "Request") -> None:
        """Queue copies of the request's newly sealed, owned pages (one host block each)."""
        rid = req.request_id
        rec = self.records.get(rid)
        if rec is None:
            return
        t = self.kv.table(rid, self.group)
        sealed = min(req.num_computed_tokens // self.tpp, len(t.blocks))
        i = rec.next_seal
        while i < sealed:
            if i not in rec.host_blocks and t.is_owned(i):
                hb = self.host.allocate()
                if hb is None:
                    break  # host pool full: the page stays dirty; retried after the next step
                rec.host_blocks[i] = hb
                rec.pending.add(i)
                key = None
                if self.prefix_cache is not None and self.prefix_cache.host_pool is not None:
                    key = self.prefix_cache.block_hashes(req, (i + 1) * self.tpp)[i]
                self.host.enqueue(CopyJob(t.blocks[i], hb, rec, i, key))
            i += 1
        rec.next_seal = i

    # ------------------------------------------------------------------ step inputs
    def take_stores(self, max_copies: int) -> list[CopyJob]:
        """The copies to run at the start of the step being prepared (at most `max_copies`).

        Copies of requests that are gone (finished, aborted, preempted) go first: their device
        pages are free and the next step may reuse them, so they run now or never (the excess is
        cancelled); copies of running requests may wait (their pages stay owned)."""
        live = set(map(id, self.records.values()))
        dead = [j for j in self.host.queue if id(j.owner) not in live]
        rest = [j for j in self.host.queue if id(j.owner) in live]
        for j in dead[max_copies:]:
            self.host.blocks.free([j.host_block])
        self.host.queue.clear()
        self.host.queue.extend(dead[:max_copies] + rest)
        return self.host.take_stores(max_copies)

    def hot_rows(self, req: "Request", first_chunk: bool) -> tuple[list[int], int]:
        """(lease pages, reset_from) of a scheduled request: hot slots from `reset_from` on are
        stale (their page changed since the request's state was last resolved, or the state row
        is new). A request without a lease gets ([], 0)."""
        rec = self.records.get(req.request_id)
        if rec is None or not rec.lease:
            if rec is not None:
                rec.seen_lease = None
            return [], 0
        seen = None if first_chunk else rec.seen_lease
        if seen is None:
            reset = 0
        else:
            same = 0
            while same < min(len(seen), len(rec.lease)) and seen[same] == rec.lease[same]:
                same += 1
            reset = (same * self.hot_tpp if same < len(rec.lease) or len(seen) > len(rec.lease)
                     else self.grow_pages * self.hot_tpp)
        rec.seen_lease = list(rec.lease)
        return list(rec.lease), reset

    def host_table(self, rid: str, width: int) -> np.ndarray:
        """int32 `[width]`: the host block of each MLA page of the request (0 = none)."""
        out = np.zeros(width, np.int32)
        rec = self.records.get(rid)
        if rec is not None:
            for i, b in rec.host_blocks.items():
                if i < width and i not in rec.pending:
                    out[i] = b
        return out

    # ------------------------------------------------------------------ checks
    def external_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for rec in self.records.values():
            for b in rec.lease:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def audit(self) -> list[str]:
        """Host pool refcounts; every released or lost page has a complete host copy; pending
        pages have a copy queued or in flight; requests with off-device pages hold a lease of at
        least the decode size; records exist exactly for the requests with tables."""
        errors: list[str] = []
        refs: dict[int, int] = {}
        jobs = {(id(j.owner), j.page_index) for j in list(self.host.queue) + self.host.in_flight}
        for rid, rec in self.records.items():
            for b in rec.host_blocks.values():
                refs[b] = refs.get(b, 0) + 1
            if not self.kv.has_request(rid):
                errors.append(f"hisparse record for {rid!r}, which holds no tables")
                continue
            t = self.kv.table(rid, self.group)
            for i in sorted(set(t.released) | t.placeholders):
                if i not in rec.host_blocks or i in rec.pending:
                    errors.append(f"{rid!r} page {i} is off the device without a complete host copy")
            if (t.released or t.placeholders) and len(rec.lease) < self.least_pages:
                errors.append(f"{rid!r} has off-device pages but a lease of {len(rec.lease)} pages")
            for i in rec.pending:
                if (id(rec), i) not in jobs:
                    errors.append(f"{rid!r} page {i} is pending without a queued copy")
            if len(rec.lease) > self.grow_pages:
                errors.append(f"{rid!r} leases {len(rec.lease)} pages > {self.grow_pages}")
        for rid in self.kv.request_ids():
            if rid not in self.records:
                errors.append(f"request {rid!r} has tables but no hisparse record")
        errors += self.host.audit(refs)
        return errors
