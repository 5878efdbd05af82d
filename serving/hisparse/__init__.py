"""Hybrid HiSparse (DESIGN §6.1): a residency policy over the one device pool, a host pool of
sealed MLA pages, hot-buffer leases and the resolver inside the jitted step.

    python -m serving.run --attention-config '{"hisparse_config": {"host_pool_gib": 64}}'

* `config.py`    — `hisparse_config` keys, defaults and start-up checks.
* `host_pool.py` — host blocks (refcounted, LRU, prefix-cache host tier) and the write-through
                   copy queue.
* `residency.py` — page states (dirty → clean → released → lost), releases under pressure, hot
                   leases, admission and the prefill chunk bound: `HiSparsePolicy`, a
                   `serving.kv_policy` policy the scheduler calls.
* `device_state.py` — the host pool array and per-request hot state the runner threads through
                   its step, and the per-step `HotBatch`.

The model side is `glm53/hot_cache.py` + `glm53.attention.resolve_hot`; the ops are
`kernels/hot_resolve` (the resolver) and `kernels/host_rows` (page stores, host → hot row copies).
`build_hisparse` wires them for an engine.
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


@dataclass
class HiSparse:
    """One engine's HiSparse pieces (see the module docstring)."""

    config: ResolvedHiSparse
    host: HostPool
    policy: HiSparsePolicy
    device: HiSparseDeviceState
    prefix_cache: object
    num_index_groups: int
    index_topk: int

    def gauges(self) -> HiSparseGauges:
        d = self.device
        return HiSparseGauges(self.policy.residency_counts, self.host.usage,
                              lambda: (d.hits, d.misses, d.h2d_bytes))

    def plan(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int):
        """The planner's prediction for requests of `max_model_len` tokens on this pool, under the
        engine's admission rule (`glm53.capacity.predict_hisparse_requests`)."""
        from glm53.capacity import predict_hisparse_requests

        return predict_hisparse_requests(self.policy.kv, num_blocks, max_model_len, self.config.device_buffer_rows,
                                         host_blocks=self.host.num_usable, reserve_per_request=1,
                                         window_tokens=2 * max_num_batched_tokens,
                                         prefill_hot_rows=self.config.max_hot_rows)

    def summary(self, num_blocks: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> str:
        """The start-up log line: the planner's predicted steady-state concurrency for this pool."""
        plan = self.plan(num_blocks, max_model_len, max_num_batched_tokens)
        return (f"HiSparse: host pool {self.host.num_usable} blocks x {self.device.host_block_bytes / 2**20:.2f} MiB "
                f"({self.host.num_usable * self.device.host_block_bytes / 2**30:.3f} GiB, {self.config.mechanism} "
                f"transfers); hot buffer {self.config.device_buffer_rows} rows per decoding request "
                f"({plan.hot_pages} pages), up to {self.config.max_hot_rows} while prefilling; predicted steady "
                f"state: {plan.requests} requests of {max_model_len} tokens (device-bound {plan.device_bound}: "
                f"first {plan.first_pages} pages + {plan.steady_pages} + 1 headroom per other request; host-bound "
                f"{plan.host_bound}); running at once <= min({plan.requests}, --max-num-seqs {max_num_seqs})")


def build_hisparse(config: HiSparseConfig, kv, layout, model_cfg, args, on_host_reuse, offload=None,
                   num_speculative_tokens: int = 0) -> HiSparse:
    """Size and check the host pool, and build the policy (and, with --enable-prefix-caching, a
    prefix cache with a host tier, and the offloading connector's tier when `offload`, an
    `OffloadStore`, is given) over `kv` for an engine with `args`. With MTP speculation
    (`num_speculative_tokens` k > 0) the hot buffer defaults to (k + 2) × index_topk rows per
    decoding request (k + 1 verification rows may each miss all of their top-k); the MTP layer's
    own KV (`mtp` group) stays device-resident like the indexer keys.

    Raises HiSparseConfigError (a ValueError) naming the `hisparse_config` key: a device buffer
    below (spec + 1) × index_topk, a host pool that cannot hold one --max-model-len request or
    that exceeds the available host memory."""
    from serving.prefix_cache import PrefixCache

    mla = layout.group("mla")
    tpp = mla.tokens_per_page
    resolved = config.resolve(index_topk=model_cfg.index_topk, tokens_per_page=tpp,
                              num_speculative_tokens=num_speculative_tokens)
    host_block_bytes = mla.bytes_per_token * tpp
    num_host = resolved.host_blocks(host_block_bytes)
    check_host_pool(num_host, host_block_bytes, args.max_model_len, tpp)
    host = HostPool(num_host, on_reuse=on_host_reuse)
    prefix_cache = (PrefixCache(kv, host_pool=host.blocks, offload=offload) if args.enable_prefix_caching
                    else None)
    policy = HiSparsePolicy(kv, host, resolved, model_cfg.index_topk, prefix_cache)
    groups = len(model_cfg.full_layers)
    device = HiSparseDeviceState(resolved, mla, num_host, args.max_num_seqs, groups,
                                 max_stores_per_step(args.max_num_batched_tokens, args.max_num_seqs, tpp), policy)
    avail = available_host_memory()
    logger.info("HiSparse host pool: %d blocks (%.3f GiB) of the %s available", num_host - 1,
                (num_host - 1) * host_block_bytes / 2**30,
                f"{avail / 2**30:.1f} GiB" if avail is not None else "unknown amount of memory")
    return HiSparse(resolved, host, policy, device, prefix_cache, groups, model_cfg.index_topk)


__all__ += ["HiSparseGauges", "RESIDENCY_STATES", "ResolvedHiSparse", "check_host_pool"]
