"""Hybrid HiSparse (docs/design.md §6.1): a residency policy over the one device pool, a host pool of
sealed MLA pages, hot-buffer leases and the resolver inside the jitted step.

    python -m serving.run --attention-config '{"hisparse_config": {"host_pool_gib": 64}}'

* `config.py`    — `hisparse_config` keys, defaults and start-up checks.
* `host_pool.py` — host blocks (refcounted, LRU, prefix-cache host tier) and the write-through
                   copy queue.
* `residency.py` — page states (dirty → clean → released → lost), releases under pressure, hot
                   leases, admission and the prefill chunk sizing: `HiSparsePolicy`, a
                   `serving.kv_policy` policy the scheduler calls.
* `device_state.py` — the host pool array and per-request hot state the runner threads through
                   its step, and the per-step `HotBatch`.
* `truncation.py` — adaptive prefill sizing's truncated steps: a chunk that overflowed its lease
                   is kept up to its first dropped selection.

The model side is `glm53/hot_cache.py` + `glm53.attention.resolve_hot`; the ops are
`kernels/hot_resolve` (the resolver) and `kernels/host_rows` (page stores, host → hot row copies).
`build_hisparse` wires them for an engine — on one device or any parallel layout: one host pool,
policy and prefix cache per data-parallel replica; the device state's arrays sharded per KV shard
(replica × DCP rank), the pool's columns split over the ranks that hold the same KV (TP). Design:
docs/hisparse.md, "Parallel layouts".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from serving.hisparse.config import (HiSparseConfig, HiSparseConfigError, ResolvedHiSparse, available_host_memory,
                                     check_host_pool)
from serving.hisparse.device_state import HiSparseDeviceState, max_stores_per_step
from serving.hisparse.host_pool import HostPool
from serving.hisparse.residency import RESIDENCY_STATES, HiSparsePolicy

logger = logging.getLogger(__name__)

__all__ = ["HiSparse", "HiSparseConfig", "HiSparseConfigError", "HiSparsePolicy", "build_hisparse",
           "hisparse_config"]


def hisparse_config(attention_config: dict | None) -> HiSparseConfig | None:
    """The `hisparse_config` of an `--attention-config` dict, parsed (None when absent).
    Raises HiSparseConfigError naming the key."""
    if not attention_config or attention_config.get("hisparse_config") is None:
        return None
    return HiSparseConfig.from_dict(attention_config["hisparse_config"])


@dataclass
class HiSparseGauges:
    """Live HiSparse state for the metrics: running requests per residency state and the host
    pool's usage (fraction of blocks referenced) and lookup totals."""

    residency: callable
    host_pool_usage: callable
    totals: callable  # → (hits, misses, host → device bytes) since start-up
    policy_totals: callable = None  # → {counter: value} of the residency policies, since start-up


@dataclass
class HiSparse:
    """One engine's HiSparse pieces (see the module docstring). Under data parallelism `hosts`,
    `policies` and `prefix_caches` hold one per replica (`host`, `policy`, `prefix_cache` are
    replica 0's); `device` is shared (its arrays have one shard per replica and DCP rank)."""

    config: ResolvedHiSparse
    host: HostPool
    policy: HiSparsePolicy
    device: HiSparseDeviceState
    prefix_cache: object
    num_index_groups: int
    index_topk: int
    hosts: list = None
    policies: list = None
    prefix_caches: list = None
    dcp: int = 1

    def __post_init__(self):
        self.hosts = self.hosts or [self.host]
        self.policies = self.policies or [self.policy]
        self.prefix_caches = self.prefix_caches or [self.prefix_cache]

    def gauges(self) -> HiSparseGauges:
        d = self.device

        def residency():
            out: dict[str, int] = {}
            for p in self.policies:
                for k, v in p.residency_counts().items():
                    out[k] = out.get(k, 0) + v
            return out

        def policy_totals():
            return {k: sum(getattr(p, attr) for p in self.policies) for k, attr in (
                ("pages_released", "num_released"), ("shared_pages_released", "num_released_shared"),
                ("requests_revived", "num_revived"), ("squeezed_lease_steps", "num_squeezed_steps"))}

        return HiSparseGauges(residency, lambda: sum(h.usage() for h in self.hosts) / len(self.hosts),
                              lambda: (d.hits, d.misses, d.h2d_bytes), policy_totals)

    def plan(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int):
        """The planner's prediction for requests of `max_model_len` tokens on one replica's pool,
        under the engine's admission rule (`glm53.capacity.predict_hisparse_requests`; under DCP
        in engine pages with leases of per-rank rows)."""
        from glm53.capacity import predict_hisparse_requests

        return predict_hisparse_requests(self.policy.kv, num_blocks, max_model_len, self.config.device_buffer_rows,
                                         host_blocks=self.host.num_usable, reserve_per_request=1,
                                         window_tokens=2 * max_num_batched_tokens,
                                         prefill_hot_rows=self.config.prefill_hot_rows,
                                         hot_tokens_per_page=self.device.tpp)

    def summary(self, num_blocks: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> str:
        """The start-up log line: the planner's predicted steady-state concurrency for this pool
        (per replica, and in all under data parallelism)."""
        plan = self.plan(num_blocks, max_model_len, max_num_batched_tokens)
        nrep = len(self.policies)
        engine_block = self.device.host_block_bytes * self.dcp  # one host block over the replica's DCP ranks
        where = ""
        if nrep > 1 or self.dcp > 1:
            where = (f" per replica ({nrep} replicas: {nrep * min(plan.requests, max_num_seqs)} in all)"
                     if nrep > 1 else "")
        dcp_note = (f"; DCP {self.dcp}: each rank keeps its token share of every host block and a hot buffer of "
                    f"{self.config.device_buffer_rows} rows per decoding request (any rank may own a whole top-k), "
                    f"{self.dcp}x the single-device hot rows over the group" if self.dcp > 1 else "")
        grow = (f" (up to {self.config.max_hot_rows} in free pages while it is the only request)"
                if self.config.max_hot_rows > self.config.prefill_hot_rows else "")
        return (f"HiSparse: host pool {self.host.num_usable} blocks x {engine_block / 2**20:.2f} MiB "
                f"({self.host.num_usable * engine_block / 2**30:.3f} GiB per replica, {self.config.mechanism} "
                f"transfers); hot buffer {self.config.device_buffer_rows} rows per decoding request "
                f"({plan.hot_pages} pages), up to {self.config.prefill_hot_rows} while prefilling{grow}{dcp_note}; predicted "
                f"steady state: {plan.requests} requests of {max_model_len} tokens{where} (device-bound "
                f"{plan.device_bound}: first {plan.first_pages} pages + {plan.steady_pages} + 1 headroom per other "
                f"request; host-bound {plan.host_bound}); running at once <= min({plan.requests}, --max-num-seqs "
                f"{max_num_seqs})")


def build_hisparse(config: HiSparseConfig, kv, layout, model_cfg, args, on_host_reuse, offload=None,
                   num_speculative_tokens: int = 0, parallel=None) -> HiSparse:
    """Size and check the host pool, and build the policy (and, with --enable-prefix-caching, a
    prefix cache with a host tier, and the offloading connector's tier when `offload`, an
    `OffloadStore` or one per data-parallel replica, is given) over `kv` for an engine with `args`. With MTP speculation
    (`num_speculative_tokens` k > 0) the hot buffer defaults to (k + 2) × index_topk rows per
    decoding request (k + 1 verification rows may each miss all of their top-k); the MTP layer's
    latent rows are one more layer of the `mla` group, so they go to the host pool with their
    pages and the MTP layer resolves its top-k through the hot buffer as one more index group
    (its keys stay on the device with the backbone's).

    Parallel layouts (`parallel`, a `sharding.mesh.ParallelLayout`): `kv` and `on_host_reuse` may
    be lists, one per data-parallel replica — each replica gets its own host pool of
    `host_pool_gib`, policy and prefix cache. A host block is an engine page (under DCP `g · N`
    tokens, each rank holding its `g`-token share in its own part of the pool); devices that
    hold the same KV (TP) share one copy (`glm53.attention.host_split_axes`).

    Raises HiSparseConfigError (a ValueError) naming the `hisparse_config` key: a device buffer
    below (spec + 1) × index_topk, a host pool that cannot hold one --max-model-len request or
    that exceeds the available host memory."""
    from glm53.kv_layout import mtp_layers_in
    from serving.prefix_cache import PrefixCache

    kvs = list(kv) if isinstance(kv, (list, tuple)) else [kv]
    reuse = list(on_host_reuse) if isinstance(on_host_reuse, (list, tuple)) else [on_host_reuse]
    offloads = list(offload) if isinstance(offload, (list, tuple)) else [offload] * len(kvs)
    dcp = parallel.dcp if parallel is not None else 1
    mla = layout.group("mla")
    tpp = mla.tokens_per_page
    resolved = config.resolve(index_topk=model_cfg.index_topk, tokens_per_page=tpp,
                              num_speculative_tokens=num_speculative_tokens)
    host_block_bytes = mla.bytes_per_token * tpp * dcp  # an engine page over the replica's DCP ranks
    num_host = resolved.host_blocks(host_block_bytes)
    check_host_pool(num_host, host_block_bytes, args.max_model_len, tpp * dcp,
                    replicas=len(kvs))
    hosts, policies, caches = [], [], []
    for r, kv_r in enumerate(kvs):
        host = HostPool(num_host, on_reuse=reuse[r])
        prefix_cache = (PrefixCache(kv_r, host_pool=host.blocks, offload=offloads[r]) if args.enable_prefix_caching
                        else None)
        hosts.append(host)
        caches.append(prefix_cache)
        policies.append(HiSparsePolicy(kv_r, host, resolved, model_cfg.index_topk, prefix_cache, hot_tpp=tpp))
    # One hot-state index group per full layer, and one per MTP layer when the layout holds its
    # rows (`glm53.mtp.mtp_forward` resolves through group F = len(full_layers)).
    groups = len(model_cfg.full_layers) + mtp_layers_in(layout, model_cfg)
    device = HiSparseDeviceState(resolved, mla, num_host, args.max_num_seqs, groups,
                                 max_stores_per_step(args.max_num_batched_tokens, args.max_num_seqs, tpp * dcp),
                                 policies, parallel=parallel)
    avail = available_host_memory()
    logger.info("HiSparse host pool: %d blocks (%.3f GiB) per replica x %d replica(s) of the %s available",
                num_host - 1, (num_host - 1) * host_block_bytes / 2**30, len(kvs),
                f"{avail / 2**30:.1f} GiB" if avail is not None else "unknown amount of memory")
    return HiSparse(resolved, hosts[0], policies[0], device, caches[0], groups, model_cfg.index_topk,
                    hosts, policies, caches, dcp)


__all__ += ["HiSparseGauges", "RESIDENCY_STATES", "ResolvedHiSparse", "check_host_pool"]
