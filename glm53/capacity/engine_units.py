"""Capacity in the engine's own units: arena pages of each KV cache group, device-resident and
under Hybrid HiSparse's admission rule (what the engine logs at start-up and what the HiSparse
planner admits by)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from glm53.capacity.kv_bytes import (
    TAIL_PAGES,
    MiB,
)


def pages_per_request(groups, num_tokens: int) -> dict[str, int]:
    """Pages each KV cache group needs for `num_tokens` positions: ⌈L / tokens_per_page_g⌉.

    groups: a `glm53.kv_layout.KVCacheLayout` or any iterable of objects with `name` and
    `tokens_per_page` (e.g. `serving.kv_cache.KVCacheGroupSpec`).
    """
    gs = getattr(groups, "groups", groups)
    return {g.name: math.ceil(num_tokens / g.tokens_per_page) for g in gs}


def predict_device_resident_requests(layout, num_blocks: int, max_model_len: int) -> int:
    """How many equal requests of `max_model_len` tokens fit in the engine's arena at once.

    Every request holds ⌈L / tpp_g⌉ pages in each group g of `layout` (pages of all groups come
    from one pool; docs/design.md §6.1.1); block 0 is the null block, so `num_blocks − 1` pages are
    usable: ⌊(num_blocks − 1) / Σ_g ⌈L / tpp_g⌉⌋. (A request that reaches L tokens has written
    KV for L − 1 positions; the two counts differ only when L ≡ 1 mod some tpp_g.)
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    per_req = sum(pages_per_request(layout, max_model_len).values())
    return (num_blocks - 1) // per_req


@dataclass(frozen=True)
class HiSparsePagePlan:
    """HiSparse capacity in arena pages (engine units).

    first_pages: the admitted request fully resident plus its hot lease. steady_pages: another
    request's indexer/other resident groups + hot lease + tail pages. device_bound / host_bound:
    request counts (host_bound None without a host pool size).
    """

    first_pages: int
    steady_pages: int
    hot_pages: int
    device_bound: int
    host_bound: int | None

    @property
    def requests(self) -> int:
        """min(device_bound, host_bound) (device_bound alone without a host pool size)."""
        return self.device_bound if self.host_bound is None else min(self.device_bound, self.host_bound)


def predict_hisparse_requests(layout, num_blocks: int, max_model_len: int, hot_rows: int,
                              host_blocks: int | None = None, offloaded: tuple[str, ...] = ("mla",),
                              tail_pages: int = TAIL_PAGES, reserve_pages: int = 0, reserve_per_request: int = 0,
                              window_tokens: int | None = None, prefill_hot_rows: int | None = None,
                              hot_tokens_per_page: int | None = None) -> HiSparsePagePlan:
    """docs/design.md §9's HiSparse device-bound and host-bound counts in pages of `layout`.

    The `offloaded` groups (the sparse-MLA group) keep only `tail_pages` pages per request on
    the device, plus a hot lease of ⌈hot_rows / tpp⌉ pages of the first offloaded group (hot
    pages are indexed by token row); every other group stays fully resident. Device-bound:
    1 + ⌊(usable − reserve − first) / (steady + reserve_per_request)⌋ (0 if the first request
    does not fit; `reserve_pages` / `reserve_per_request`: headroom the engine keeps free for
    the running requests' growth while it admits another — `HiSparsePolicy` keeps one page per
    running request). Host-bound: ⌊host_blocks / Σ_offloaded ⌈L / tpp_g⌉⌋ when `host_blocks`
    (pages of the host pool) is given.

    This is the engine's admission rule (`serving/hisparse/residency.py`): a request is admitted
    when it fits fully resident (with its lease) next to the others at their steady footprint
    and the reserve. A request that cannot be fully resident even in an empty pool is admitted
    with an in-flight window instead: the offloaded groups' pages of `window_tokens` tokens (the
    engine: two prefill chunks) and a prefill hot buffer of `prefill_hot_rows` rows, next to the
    other groups' pages of the whole context (without `window_tokens`, such a request gives 0).

    Under decode context parallelism pass the engine's pages (`g · N` tokens) as `layout` and
    `hot_tokens_per_page = g`: a leased engine page is a `g`-row page on each of the N ranks, and
    every rank's hot buffer must hold `hot_rows` rows (any rank may own a whole top-k), so the
    lease is ⌈hot_rows / g⌉ engine pages — N times the single-device hot rows over the group.
    """
    pages = pages_per_request(layout, max_model_len)
    gs = {g.name: g for g in getattr(layout, "groups", layout)}
    unknown = [g for g in offloaded if g not in gs]
    if unknown or not offloaded:
        raise ValueError(f"offloaded groups {offloaded} not all in the layout's {sorted(gs)}")
    hot_tpp = hot_tokens_per_page or gs[offloaded[0]].tokens_per_page
    hot_pages = math.ceil(hot_rows / hot_tpp)
    usable = num_blocks - 1
    first = sum(pages.values()) + hot_pages
    resident_rest = sum(n for g, n in pages.items() if g not in offloaded)
    if first > usable and window_tokens is not None:  # the in-flight window
        win = pages_per_request([gs[g] for g in offloaded], min(max_model_len, window_tokens))
        pre = math.ceil((prefill_hot_rows or hot_rows) / hot_tpp)
        first = resident_rest + sum(win.values()) + tail_pages * len(offloaded) + max(hot_pages, pre)
    steady = resident_rest + hot_pages + tail_pages * len(offloaded)
    device_bound = 0 if usable < first else 1 + max(0, usable - reserve_pages - first) // (steady + reserve_per_request)
    host_bound = None
    if host_blocks is not None:
        host_bound = host_blocks // sum(pages[g] for g in offloaded)
    return HiSparsePagePlan(first, steady, hot_pages, device_bound, host_bound)


def engine_capacity_summary(layout, num_blocks: int, max_model_len: int, max_num_seqs: int | None = None, *,
                            dcp: int = 1, dp: int = 1) -> str:
    """One log line: how many requests of `max_model_len` tokens the engine's pool holds
    device-resident (`predict_device_resident_requests`), with the pages each one needs.

    Under decode context parallelism (`dcp` ranks) an engine page spans `tokens_per_page × dcp`
    tokens (each rank stores its share in its own arena shard, `num_blocks` pages per rank), so a
    request needs ⌈L / (tpp_g · dcp)⌉ engine pages per group; with `dp` data-parallel replicas
    (each with its own pool of `num_blocks` pages and its own `max_num_seqs`) the engine holds `dp`
    times one replica's count. Bytes per token are per device (the DCP shares split them).
    """
    if dcp < 1 or dp < 1:
        raise ValueError(f"dcp and dp must be >= 1, got dcp={dcp}, dp={dp}")
    groups = [_EnginePageGroup(g.name, g.tokens_per_page * dcp) for g in layout.groups]
    pages: Mapping[str, int] = pages_per_request(groups, max_model_len)
    n = predict_device_resident_requests(groups, num_blocks, max_model_len) * dp
    per_tok = sum(g.bytes_per_token for g in layout.groups) / dcp
    where = []
    if dcp > 1:
        where.append(f"DCP {dcp}: a page spans {dict((g.name, g.tokens_per_page) for g in groups)} tokens")
    if dp > 1:
        where.append(f"{dp} data-parallel replicas, each with its own pool")
    s = (f"KV capacity: {n} requests of {max_model_len} tokens fit device-resident "
         f"({sum(pages.values())} pages each: {dict(pages)}; {num_blocks - 1} usable pages of "
         f"{layout.page_bytes / MiB:.2f} MiB{' per DCP rank' if dcp > 1 else ''}"
         f"{' per replica' if dp > 1 else ''}; {per_tok:,.0f} B/token per device"
         f"{'; ' + '; '.join(where) if where else ''})")
    if max_num_seqs is not None:
        cap_seqs = max_num_seqs * dp
        s += f"; running at once ≤ min({n}, --max-num-seqs {max_num_seqs}{f' × {dp}' if dp > 1 else ''}) = " \
             f"{min(n, cap_seqs)}"
    return s


@dataclass(frozen=True)
class _EnginePageGroup:
    """A KV group in engine pages (`name`, `tokens_per_page` of one engine page)."""

    name: str
    tokens_per_page: int
