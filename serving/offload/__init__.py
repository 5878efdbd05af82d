"""The CPU KV offloading connector (vLLM's OffloadingConnector idea, docs/design.md §6.1 baseline (b)).

    python -m serving.run --enable-prefix-caching --kv-transfer-config \\
        '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":N}}'

Full pages of every KV cache group it manages are stored to a host store of `cpu_bytes_to_use`
bytes after the step that computed them; a request whose prefix the device prefix cache lost gets
those pages back from the host (loaded into fresh device pages before its first step) instead of
recomputing them, and `cached_tokens` counts them. A request runs only once all its pages are on
the device, so the connector saves prefill but does not raise concurrency: it is the baseline
Hybrid HiSparse is measured against. With HiSparse on, the connector manages the groups HiSparse
does not (the indexer keys; MTP), the two host budgets being separate flags as in the reference.

* `config.py`   — the flag's keys and checks.
* `store.py`    — host blocks, their LRU and `(group, key)` entries, the store queue, load pins.
* `transfer.py` — the host page array and the store / load programs the runner dispatches.

Lookups go through `serving.prefix_cache.PrefixCache` (its `offload` tier), allocation through
`KVCacheManager.allocate_slots(loads=...)`, and the runner runs the transfers
(`ModelRunner.run_offload`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from serving.offload.config import OffloadConfig, OffloadConfigError
from serving.offload.store import OffloadStore, OffloadTag, StoreJob
from serving.offload.transfer import OffloadTransfer

logger = logging.getLogger(__name__)

__all__ = ["Offload", "OffloadConfig", "OffloadConfigError", "OffloadStore", "OffloadTag", "OffloadTransfer",
           "StoreJob", "build_offload", "offload_config"]


def offload_config(kv_transfer_config: dict | None) -> OffloadConfig | None:
    """The OffloadingConnector's parsed `--kv-transfer-config` (alone or inside a MultiConnector), or
    None when the flag is absent or names no OffloadingConnector. Raises OffloadConfigError."""
    from serving.kv_transfer_config import KVTransferConfigError, split_kv_transfer_config

    try:
        offload, _ = split_kv_transfer_config(kv_transfer_config)
    except KVTransferConfigError as e:
        raise OffloadConfigError(str(e)) from None
    return None if offload is None else OffloadConfig.from_dict(offload)


@dataclass
class Offload:
    """One engine's connector pieces: one host store per data-parallel replica (`stores[r]` numbers
    its own host blocks, as each replica's block pool numbers its own pages; one replica without
    `--data-parallel-size`) over one `OffloadTransfer`, whose host page array holds every replica's
    blocks in its own shards."""

    config: OffloadConfig
    stores: list[OffloadStore]
    transfer: OffloadTransfer

    @property
    def store(self) -> OffloadStore:
        """Replica 0's store (the only one without data parallelism)."""
        return self.stores[0]

    def usage(self) -> float:
        """Fraction of the host blocks filed, queued or pinned, over every replica's store."""
        return sum(s.usage() for s in self.stores) / len(self.stores)

    def has_queued_stores(self) -> bool:
        return any(s.queue for s in self.stores)

    def after_step(self) -> None:
        """The step (and the transfers before it) ran: file every replica's stores, release its
        loads' host blocks."""
        for s in self.stores:
            s.complete()
            s.unpin()

    def totals(self) -> tuple[int, int, int]:
        """(pages stored, pages loaded, stores skipped) since start-up, over every replica."""
        return (sum(s.num_stored for s in self.stores), sum(s.num_loaded for s in self.stores),
                sum(s.num_skipped for s in self.stores))

    def audit(self) -> list[str]:
        """Every store's invariant violations (prefixed "replica r: " under data parallelism)."""
        if len(self.stores) == 1:
            return self.store.audit()
        return [f"replica {r}: offload store: {p}" for r, s in enumerate(self.stores) for p in s.audit()]

    def summary(self) -> str:
        s = self.store
        per = f" per replica x {len(self.stores)} replicas" if len(self.stores) > 1 else ""
        return (f"KV offloading connector: host store {s.num_usable} pages x {s.page_bytes / 2**20:.2f} MiB{per} "
                f"({s.num_usable * s.page_bytes / 2**30:.3f} GiB of cpu_bytes_to_use "
                f"{self.config.cpu_bytes_to_use / 2**30:.3f} GiB, {self.transfer.mechanism} transfers) for the "
                f"groups {list(s.groups)}")


def build_offload(config: OffloadConfig, layout, groups, parallel=None) -> Offload:
    """Size and check the host store for `layout`'s pages and build the connector over `groups`.

    `cpu_bytes_to_use` is one replica's budget: under DCP it counts the replica's ranks together
    (each stores its share of every page), and under `--data-parallel-size N` every replica gets
    its own store of that size, as every data-parallel engine of vLLM reads the same flag.

    Raises OffloadConfigError naming cpu_bytes_to_use when the store cannot hold one page, or
    the stores together exceed the host memory available."""
    from kernels.host_rows import default_mechanism
    from serving.hisparse.config import available_host_memory

    shards, replicas = 1, 1
    if parallel is not None and not parallel.is_single_device:
        from glm53.attention import num_kv_shards

        replicas = parallel.dp
        shards = num_kv_shards(parallel) // replicas  # every DCP rank stores its share of each page
    page_bytes = layout.page_bytes
    n = config.host_blocks(page_bytes * shards)
    if n < 2:
        raise OffloadConfigError(f"--kv-transfer-config kv_connector_extra_config.cpu_bytes_to_use "
                                 f"{config.cpu_bytes_to_use} holds no page of {page_bytes} bytes")
    avail = available_host_memory()
    total = (n - 1) * page_bytes * shards * replicas
    if avail is not None and total > avail:
        each = f" ({replicas} data-parallel replicas, one store each)" if replicas > 1 else ""
        raise OffloadConfigError(f"--kv-transfer-config kv_connector_extra_config.cpu_bytes_to_use "
                                 f"{total / 2**30:.3f} GiB{each} exceeds the {avail / 2**30:.3f} GiB of "
                                 "host memory available")
    stores = [OffloadStore(n, groups, page_bytes * shards) for _ in range(replicas)]
    transfer = OffloadTransfer(n, page_bytes // 4, default_mechanism(), parallel=parallel)
    return Offload(config, stores, transfer)
