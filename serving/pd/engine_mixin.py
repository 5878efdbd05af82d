"""The engine side of P/D: what `LLMEngine` (and `DataParallelEngine`) do for the connector.

A mixin of `serving.engine.LLMEngine`, kept here so the engine module stays about scheduling and
stepping: building the connector and hooking it into each replica's scheduler, turning a request's
`kv_transfer_params` into a prefill hold or a parked pull, answering side-channel jobs and queueing
arrived pulls before each step, landing the pulled rows (device page writes, HiSparse host-pool
landings through the request's lease) before the step runs, and aborting parked pulls. It uses the
engine's `args`, `layout`, `parallel`, `runner`, `hisparse`, `prefix_cache`, `scheduler`,
`structured` (a failed pull drops its grammar state) and statistics helpers.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from serving.metrics import StepRecord
from serving.pd import SchedulerConnector, build_pd, parse_kv_transfer_params, pd_config
from serving.pd.params import KVTransferParamsError
from serving.request import Request, RequestStatus
from serving.scheduler import _ABORT_STATUS, Scheduler
from serving.types import RequestOutput, SamplingParams

logger = logging.getLogger("serving.engine")


class PDEngineMixin:
    """P/D methods of the engine (module docstring). `self.pd` is the `PDConnector` or None."""

    pd = None

    def _build_pd(self, cfg, num_blocks: int, replicas):
        """The P/D connector of `--kv-transfer-config` (None without one), hooked into each
        replica's scheduler: `replicas` are (index, scheduler, kv manager, pool). Raises ValueError
        (naming the flag) for a combination this build does not serve."""
        config = pd_config(self.args.kv_transfer_config)
        if config is None:
            return None
        if self.hisparse is not None and config.is_producer:
            raise ValueError("--kv-transfer-config kv_role kv_producer / kv_both with Hybrid HiSparse: a prefill engine "
                             "hands over device-resident pages only; run HiSparse on the decode engine (kv_consumer)")
        if jax.process_index() != 0:
            # A follower of a multi-process engine: the leader owns the connector (side channel,
            # held KV, pulls in flight); this process stages, pulls and lands its own replicas'
            # pages as the leader asks (`pd_process`, serving/pd/shards.py), or, where a replica
            # spans processes, takes part in the leader's page programs (`serving/arena_pages.py`).
            from serving.pd.transfer import TransferEndpoint

            self.pd_process = self._pd_process_kv(
                num_blocks, TransferEndpoint(config.side_channel_host, config.num_transfer_sockets))
            return None
        pd = build_pd(config, self.layout, cfg, self.parallel, num_blocks, self.runner.read_pages)
        local = self._pd_process_kv(num_blocks, (pd.producer or pd.consumer).endpoint)
        if local is not None:
            from serving.pd.shards import ShardRouter

            owners = {r: self.runner.replica_owner(r, local.dcp) for r in range(self.runner.dp)}
            router = ShardRouter(local, owners, {}, self._pd_send)
            for part in (pd.producer, pd.consumer):
                if part is not None:
                    part.shards = router
            self.pd_process = local
        for index, scheduler, kv, pool in replicas:
            scheduler.kv_connector = SchedulerConnector(pd, index, kv, pool, scheduler.policy)
        logger.info("%s", pd.summary())
        return pd

    pd_process = None  # serving.pd.shards.ProcessKV: this process's part of a multi-process P/D transfer

    def _pd_send(self, op: str, msg: dict) -> None:
        """A P/D message to the followers, in step order (nothing to send in one process)."""
        if self.runner.step_sink is not None:
            self.runner.step_sink(op, msg)

    def _pd_process_kv(self, num_blocks: int, endpoint):
        """This process's `ProcessKV` over its transfer `endpoint` when P/D takes the direct path
        (a multi-process engine whose every attention replica lives inside one process), else
        None (one process, or a replica spanning processes: P/D goes through the leader)."""
        import os

        from serving.pd.shards import PER_PROCESS_ENV, ProcessKV

        if self.parallel is None or (jax.process_count() == 1 and os.environ.get(PER_PROCESS_ENV) != "1"):
            return None
        dcp = self.parallel.dcp
        owners = [self.runner.replica_owner(r, dcp) for r in range(self.runner.dp)]
        if any(o is None for o in owners):
            logger.info("P/D: an attention replica spans processes; its KV is staged and landed through the leader")
            return None
        interleave = self.parallel.config.dcp_kv_cache_interleave_size
        return ProcessKV(self.runner, self.layout, dcp, interleave, num_blocks, endpoint)

    def _pd_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, scheduler):
        """The `Request` to queue, or None when P/D parked it to pull its KV first
        (`params.kv_transfer_params`, `serving/pd/params.py`). Raises ValueError (the HTTP 400s)
        for params that are malformed, that this engine's role cannot serve, or that do not match
        the prompt or the KV layout."""
        req = Request(request_id, list(map(int, prompt_token_ids)), params)
        do_remote_decode, remote = parse_kv_transfer_params(params.kv_transfer_params)
        if not (do_remote_decode or remote):
            return req
        role = self.pd.config.kv_role if self.pd is not None else None
        if do_remote_decode:
            if self.pd is None or self.pd.producer is None:
                raise KVTransferParamsError(f"kv_transfer_params.do_remote_decode needs a prefill engine "
                                            f"(--kv-transfer-config kv_role kv_producer or kv_both); this engine's role "
                                            f"is {role}", "kv_transfer_params.do_remote_decode")
            req.do_remote_decode = True
            return req
        if self.pd is None or self.pd.consumer is None:
            raise KVTransferParamsError(f"kv_transfer_params.do_remote_prefill needs a decode engine "
                                        f"(--kv-transfer-config kv_role kv_consumer or kv_both); this engine's role is "
                                        f"{role}", "kv_transfer_params.do_remote_prefill")
        if self.has_request(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        scheduler.check_request(req)
        self.pd.consumer.add(req, remote, self._local_prefix_tokens(req))
        return None

    def _local_prefix_tokens(self, req: Request) -> int:
        """Prompt tokens this engine's prefix cache holds for `req` (device or host tiers), which a
        P/D pull then skips."""
        return self.prefix_cache.lookup(req).num_tokens if self.prefix_cache is not None else 0

    def has_request(self, request_id: str) -> bool:
        """True while `request_id` is live (waiting for its KV, waiting or running)."""
        pulling = self.pd is not None and self.pd.consumer is not None and request_id in self.pd.consumer.pending
        return pulling or self._is_scheduled(request_id)

    def _is_scheduled(self, request_id: str) -> bool:
        """The request is waiting or running in a scheduler (a data-parallel engine: any replica's)."""
        return self.scheduler.get_request(request_id) is not None

    def _queue(self, req: Request) -> None:
        """Queue a request whose pulled KV arrived (or that will be prefilled here after all)."""
        self.scheduler.add_request(req)

    def _pd_tick(self) -> list[RequestOutput]:
        """Before a step: answer the prefill side's queued side-channel jobs, and queue the
        requests whose KV arrived; a failed pull follows kv_load_failure_policy. Returns the
        outputs of requests that failed here."""
        if self.pd is None:
            return []
        outs: list[RequestOutput] = []
        if self.pd.producer is not None:
            self.pd.producer.run_jobs()
        if self.pd.consumer is not None and self.pd.consumer.pending:
            ready, failed = self.pd.consumer.poll()
            for req in ready:
                self._queue(req)
            for req, why in failed:
                if self.pd.config.kv_load_failure_policy == "recompute" or why == "nothing to pull":
                    if why != "nothing to pull":
                        logger.warning("request %s: %s; prefilling it here (kv_load_failure_policy recompute)",
                                       req.request_id, why)
                    self._queue(req)
                    continue

                logger.warning("request %s: %s (kv_load_failure_policy fail)", req.request_id, why)
                req.status = RequestStatus.FINISHED_ERROR
                out = Scheduler._output(req, [])
                out.error = f"KV transfer from the prefill engine failed: {why}"
                outs.append(out)
                self.structured.remove(req.request_id)  # its grammar state, if it had a constraint
                rec = StepRecord(is_step=False)
                rec.finished.append(self._finished_stats(req, time.monotonic()))
                self._emit(rec)
        return outs

    def _pd_writes(self) -> None:
        """Land the pulled KV admitted in this step: its page writes run before the step."""
        if self.pd is None or self.pd.consumer is None:
            return
        consumer = self.pd.consumer
        writes = consumer.take_writes()
        if writes is not None:
            self.runner.write_pages(*writes)
        plans, keys = consumer.take_plans()
        if plans:
            consumer.shards.land(plans)
        for replica, bounce, pages in consumer.take_host_writes():
            self._land_in_host_pool(replica, bounce, pages)
        if keys:
            consumer.shards.drop(keys)

    def _land_in_host_pool(self, replica: int, bounce: list[int], pages: list) -> None:
        """HiSparse host landing: each (host block, per-rank page data) goes through one of the
        request's lease pages (`bounce`): the page is written on the device, then the store
        program copies it into the host block, as a write-through copy would (it writes the host
        pool's own row format, on every DCP rank and column part)."""
        import dataclasses

        from serving.hisparse.host_pool import CopyJob

        dcp = self.parallel.dcp if self.parallel is not None else 1
        step = min(len(bounce), self.hisparse.device.max_stores)
        for i in range(0, len(pages), step):
            chunk = pages[i:i + step]
            if isinstance(chunk[0][1], tuple):  # the direct path: (plan, page index), the owner's rows
                self.pd.consumer.shards.land([dataclasses.replace(plan, pages=[(index, lb)])
                                              for (_, (plan, index)), lb in zip(chunk, bounce)])
            else:
                rows = [(replica * dcp + rank) * self.runner.num_blocks + lb
                        for (_, shards), lb in zip(chunk, bounce) for rank in range(len(shards))]
                data = np.stack([page for _, shards in chunk for page in shards])
                self.runner.write_pages(np.asarray(rows, np.int32), data)
            jobs = [CopyJob(lb, hb, None, j) for j, ((hb, _), lb) in enumerate(zip(chunk, bounce))]
            if self.runner.parallel is not None:
                jobs = [jobs if r == replica else [] for r in range(self.runner.dp)]
            self.runner.run_stores(jobs)

    def has_pending_work(self) -> bool:
        """Side-channel jobs queued for the engine thread, or held KV past abort_request_timeout
        (the driver must step even when idle)."""
        return self.pd is not None and self.pd.producer is not None and self.pd.producer.has_jobs()

    def idle_wake_after(self) -> float | None:
        """Seconds an idle driver may sleep before `has_pending_work` turns True by itself (the
        earliest P/D hold's deadline); None: until something arrives."""
        if self.pd is None or self.pd.producer is None:
            return None
        due = self.pd.producer.seconds_to_deadline()
        return None if due is None else max(0.0, due)

    def is_waiting_for_remote_kv(self) -> bool:
        """Requests wait for their KV while nothing else runs: the driver may sleep briefly."""
        return (self.pd is not None and self.pd.consumer is not None and bool(self.pd.consumer.pending))

    def _pd_abort(self, request_id: str, finished_reason: str) -> RequestOutput | None:
        """Abort a request still waiting for its KV (the pull is dropped, the prefill side told)."""
        if self.pd is None or self.pd.consumer is None:
            return None
        req = self.pd.consumer.abort(request_id)
        if req is None:
            return None

        if finished_reason not in _ABORT_STATUS:
            raise ValueError(f"finished_reason must be one of {sorted(_ABORT_STATUS)}, got {finished_reason!r}")
        req.status = _ABORT_STATUS[finished_reason]
        rec = StepRecord(is_step=False)
        rec.finished.append(self._finished_stats(req, time.monotonic()))
        self._emit(rec)
        return Scheduler._output(req, [])
