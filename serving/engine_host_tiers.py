"""The engine's host tiers around its steps: building the KV offloading connector
(`--kv-transfer-config`), routing the device and host pools' reuse callbacks to their owners
(prefix cache, released HiSparse pages), completing the connector's stores and loads after a
step, and flushing HiSparse's and the connector's queued copies when the engine goes idle.
`HostTiersMixin` is mixed into `serving.engine.LLMEngine`, which provides `args`, `parallel`,
`kv`, `prefix_cache`, `hisparse`, `offload` and `runner`.
"""

from __future__ import annotations

import logging

from serving.offload import build_offload, offload_config

logger = logging.getLogger("serving.engine")


class HostTiersMixin:
    """The offloading connector and HiSparse host pool around the engine's steps (module
    docstring)."""

    def _build_offload(self, layout, with_hisparse: bool):
        """The OffloadingConnector of `--kv-transfer-config` (None without the flag): it manages
        every KV cache group, or with Hybrid HiSparse the groups HiSparse does not (docs/design.md §6.1).
        Raises ValueError (naming the flag) without prefix caching."""
        config = offload_config(self.args.kv_transfer_config)
        if config is None:
            return None
        if not self.args.enable_prefix_caching:
            raise ValueError("--kv-transfer-config OffloadingConnector needs --enable-prefix-caching")
        groups = [g.name for g in layout.groups if not (with_hisparse and g.name == "mla")]
        off = build_offload(config, layout, groups, self.parallel)
        logger.info("%s", off.summary())
        return off

    def _on_block_reuse(self, block: int, tag) -> None:
        """The pool's reuse callback: route the tag to its owner (prefix cache, released pages)."""
        if self.prefix_cache is not None and self.prefix_cache.on_block_reuse(block, tag):
            return
        self.kv.on_block_reuse(block, tag)

    def _on_host_block_reuse(self, block: int, tag) -> None:
        """The HiSparse host pool's reuse callback: a host block filed in the prefix cache's host
        tier was handed out again."""
        if self.prefix_cache is not None:
            self.prefix_cache.on_host_block_reuse(block, tag)

    def _flush_if_idle(self) -> None:
        """Nothing left to run: complete HiSparse's queued write-through copies and the
        connector's queued stores now (the last pages of finished or aborted requests go to the
        host tiers) rather than with the next request's step."""
        if self.has_unfinished_requests():
            return
        if self.hisparse is not None and any(h.queue for h in self.hisparse.hosts):
            self._flush_host_copies()
        if self.offload is not None and self.offload.has_queued_stores():
            self.runner.run_offload([[] for _ in self.offload.stores], wait=True)
            self._after_offload()

    def _after_offload(self) -> None:
        """The step (and the connector transfers before it) ran: file the stores, release the
        loads' host blocks."""
        if self.offload is not None:
            self.offload.after_step()

    def _flush_host_copies(self) -> None:
        """The engine went idle with write-through copies queued (pages sealed by the last step,
        which finished requests leave to the host tier): run them now, in a store-only program,
        so their host copies complete and are published."""
        from serving.scheduler_output import SchedulerOutput

        hs = self.hisparse
        while any(h.queue for h in hs.hosts):
            jobs = [p.take_stores(hs.device.max_stores) for p in hs.policies]
            self.runner.run_stores(jobs if self.runner.parallel is not None else jobs[0], wait=True)
            for p in hs.policies:
                p.after_update(SchedulerOutput())
