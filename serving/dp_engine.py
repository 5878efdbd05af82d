"""Data-parallel serving: `--data-parallel-size N` attention replicas behind one engine.

The reference decode engine's layout (docs/design.md §7): N attention replicas (each its own requests,
scheduler, block pool, KV block tables and prefix cache; attention runs on the replica's own
devices over its own KV) with the routed experts split over every device (`--enable-expert-
parallel`), optionally TP inside each replica (`dp × pcp × tp` devices in all).

Each engine step asks every replica's scheduler for its step and runs ONE jitted step for all of
them (`ModelRunner.execute_replicas`: the replicas' batches stacked replica-major, each padded to
the bucket of the largest; a replica with no work runs padding rows that write nothing). Each
replica's sampled rows go back to its own scheduler; the outputs are merged in replica order.

The KV arena is `uint32[dp · dcp · num_blocks, page_words]`: replica r owns shards
`r · dcp … r · dcp + dcp − 1` (its DCP ranks), each of `num_blocks` pages with block 0 the null
block. Every replica's block pool numbers pages 1 … num_blocks − 1 inside its own shards, so a
request's pages live only in its replica's shards.

Placement policy (`assign`), prefix-aware: a request goes to the replica whose prefix cache holds
the longest prefix of its prompt (device pages count fully; pages only in a HiSparse host pool or
the offload tier count half, since they must be read or loaded back), among the replicas that are
not overloaded: at most `PREFIX_LOAD_SLACK` more unfinished (waiting + running) requests than the
least-loaded replica. Without a hit (or without prefix caching) that is the least-loaded replica;
ties go to the replica using the fewest KV pages, then to the one placed the fewest requests so far
(so requests sent one at a time, each finding the engine idle, alternate over the replicas and
their prefix caches and host stores, instead of all filling replica 0's), then to the lowest index. A router's
`X-data-parallel-rank` (`SamplingParams.data_parallel_rank`) overrides the choice. A request stays
on its replica until it finishes (preemption re-queues it there). A P/D request is placed when it
arrives, so its pull skips the prefix that replica already holds.

`--max-num-seqs` and `--max-num-batched-tokens` hold per replica (each replica's step has its own
rows and token budget); `--num-gpu-blocks-override` counts the pages of one arena shard.

Metrics aggregate over replicas: running / waiting are sums, KV usage is the mean usage (all pools
have the same size, so this is the share of all pages in use), prefix-cache queries/hits are
sums. `audit()` checks every replica and that request ids are unique across replicas.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from glm53.tokenizer import tokenizer_vocab_size
from serving.block_pool import BlockPool
from serving.engine import EngineArgs, LLMEngine
from serving.hisparse import build_hisparse, hisparse_config
from serving.hisparse.truncation import truncate_step
from serving.kv_cache import KVCacheGroupSpec, KVCacheManager
from serving.kv_events import build_kv_events
from serving.metrics import EngineGauges, LoggingStatLogger, StepRecord
from serving.prefix_cache import PrefixCache
from serving.request import Request
from serving.runner import ModelRunner
from serving.scheduler import Scheduler, SchedulerConfig
from serving.spec_decode import DraftController, SpecDecodingStats, SpeculativeConfig
from serving.types import RequestOutput, SamplingParams
from sharding.mesh import ParallelLayout

logger = logging.getLogger(__name__)

# A conversation sticks to the replica holding its prefix unless that replica has this many more
# unfinished requests than the least-loaded one.
PREFIX_LOAD_SLACK = 2


@dataclass
class EngineReplica:
    """One attention replica's host-side state: its block pool (pages 0 … num_blocks − 1 of its
    own arena shards), KV cache manager, optional prefix cache and scheduler."""

    index: int
    pool: BlockPool
    kv: KVCacheManager
    prefix_cache: PrefixCache | None
    scheduler: Scheduler

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_requests_running + self.scheduler.num_requests_waiting

    def on_block_reuse(self, block: int, tag) -> None:
        """The pool's reuse callback: route the tag to its owner (prefix cache, released pages)."""
        if self.prefix_cache is not None and self.prefix_cache.on_block_reuse(block, tag):
            return
        self.kv.on_block_reuse(block, tag)

    def on_host_block_reuse(self, block: int, tag) -> None:
        """The replica's HiSparse host pool's reuse callback (its prefix cache's host tier)."""
        if self.prefix_cache is not None:
            self.prefix_cache.on_host_block_reuse(block, tag)


@dataclass
class PlacementStats:
    """Replica placements since start-up (metrics): requests per replica, how many a router
    pinned (`X-data-parallel-rank`), and the prefix-hit tokens of the chosen replica at placement."""

    num_replicas: int
    placed: list[int] = field(default_factory=list)
    pinned: int = 0
    prefix_hit_tokens: int = 0

    def __post_init__(self):
        self.placed = [0] * self.num_replicas

    def record(self, replica: int, hit_tokens: int | None) -> None:
        """`hit_tokens` None: the request was pinned by the router."""
        self.placed[replica] += 1
        if hit_tokens is None:
            self.pinned += 1
        else:
            self.prefix_hit_tokens += hit_tokens


class DataParallelEngine(LLMEngine):
    """`LLMEngine` over `dp` attention replicas (see the module docstring). Built by
    `serving.engine_factory.build_engine` when `args.parallel.data_parallel_size > 1`; same public interface
    (`add_request`, `abort`, `step`, `has_unfinished_requests`, `audit`, `gauges`).

    Attributes: `replicas` (list of `EngineReplica`), `runner` (one `ModelRunner` for the mesh),
    `prefix_cache` (replica 0's, for its hash unit; statistics sum over replicas).

    Raises ValueError when the parallel config has data_parallel_size < 2.
    """

    data_parallel = True

    def __init__(self, model, layout, num_blocks: int, args: EngineArgs, eos_token_ids, model_path: str):
        par = args.parallel
        if par is None or par.data_parallel_size < 2:
            raise ValueError("DataParallelEngine needs --data-parallel-size >= 2")
        self.hisparse = None  # serving.hisparse.HiSparse (one host pool, policy, prefix cache per replica)
        self.offload = None  # serving.offload.Offload (one host store per replica)
        # MTP speculation: one draft controller for every replica's scheduler (each asks it for
        # its own batch's draft count; the acceptance estimates pool every replica's verifications).
        self.spec_config = SpeculativeConfig.from_dict(args.speculative_config)
        k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 0
        self.spec_stats = SpecDecodingStats(k) if k else None
        self.drafts = DraftController(self.spec_config) if k else None
        self.drafter_override = None  # as LLMEngine's
        self.args = args
        self.model_path = model_path
        self.config = model.cfg
        self.layout = layout
        self.parallel = ParallelLayout.create(par)
        dcp = par.decode_context_parallel_size
        # Under DCP an engine page spans tokens_per_page x dcp tokens (each rank stores its share).
        groups = [KVCacheGroupSpec(g.name, g.tokens_per_page * dcp) for g in layout.groups]
        caps = {g.name: math.ceil(args.max_model_len / s.tokens_per_page) for g, s in zip(layout.groups, groups)}
        self.replicas: list[EngineReplica] = []
        self.placements = PlacementStats(par.data_parallel_size)
        for r in range(par.data_parallel_size):
            rep = EngineReplica(r, None, None, None, None)  # filled below (the pool's callback needs rep)
            rep.pool = BlockPool(num_blocks, on_reuse=rep.on_block_reuse)
            rep.kv = KVCacheManager(rep.pool, groups, caps)
            self.replicas.append(rep)
        hs_config = hisparse_config(args.attention_config)
        self.offload = self._build_offload(layout, hs_config is not None)
        if hs_config is not None:  # each replica: its own host pool of host_pool_gib, policy, prefix cache
            self.hisparse = build_hisparse(hs_config, [r.kv for r in self.replicas], layout, model.cfg, args,
                                           [r.on_host_block_reuse for r in self.replicas],
                                           offload=self.offload.stores if self.offload is not None else None,
                                           num_speculative_tokens=k, parallel=self.parallel)
        for rep in self.replicas:
            policy = None
            if self.hisparse is not None:
                rep.prefix_cache = self.hisparse.prefix_caches[rep.index]
                policy = self.hisparse.policies[rep.index]
            else:
                off_store = self.offload.stores[rep.index] if self.offload is not None else None
                rep.prefix_cache = PrefixCache(rep.kv, offload=off_store) if args.enable_prefix_caching else None
            rep.scheduler = Scheduler(
                SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len),
                rep.kv, eos_token_ids, rep.prefix_cache, policy, drafts=self.drafts)
        self.prefix_cache = self.replicas[0].prefix_cache
        self.runner = ModelRunner(model, layout, num_blocks, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, seed=args.seed,
                                  max_logprobs=args.max_logprobs, parallel=self.parallel,
                                  cuda_graph_sizes=args.cuda_graph_sizes,
                                  precompile_token_paddings=args.precompile_token_paddings,
                                  sampling_vocab_size=tokenizer_vocab_size(model_path),
                                  hisparse=self.hisparse.device if self.hisparse is not None else None,
                                  offload=self.offload, num_speculative_tokens=k)
        self.pd = self._build_pd(model.cfg, num_blocks, [(r.index, r.scheduler, r.kv, r.pool) for r in self.replicas])
        self.kv_events = build_kv_events(args.kv_events_config, [r.prefix_cache for r in self.replicas])
        self.async_scheduling = self._async_scheduling(args)
        self.eos_token_ids = tuple(eos_token_ids)
        self._structured_init(model_path, model.cfg.vocab_size, eos_token_ids, args.structured_outputs_config)
        self.num_steps = 0
        self.host_overhead_s = 0.0
        reps = self.replicas
        self.gauges = EngineGauges(lambda: sum(r.scheduler.num_requests_running for r in reps),
                                   lambda: sum(r.scheduler.num_requests_waiting for r in reps),
                                   lambda: sum(r.scheduler.kv_cache_usage for r in reps) / len(reps),
                                   self.hisparse.gauges() if self.hisparse is not None else None,
                                   self.offload.usage if self.offload is not None else None,
                                   num_speculative_tokens=k, kv_events=self.kv_events, dp_placements=self.placements)
        self.stat_loggers: list = []
        if not args.disable_log_stats:
            self.stat_loggers.append(LoggingStatLogger(self.gauges, args.log_stats_interval_s))
        self._prefix_counts = (0, 0)
        self._offload_counts = (0, 0, 0, 0, 0)  # external queries and hits, pages stored, loaded, skipped
        logger.info("data parallel: %d attention replicas x %d pages each (%s)", len(reps), num_blocks, par)

    # ------------------------------------------------------------------ requests
    def assign(self, req: Request | None = None) -> EngineReplica:
        """The replica a new request goes to (module docstring): its `data_parallel_rank` if set,
        else the longest weighted prefix hit among the replicas within `PREFIX_LOAD_SLACK`
        unfinished requests of the least loaded, then fewest unfinished requests, fewest pages in
        use, fewest placements so far, lowest index."""
        if req is not None and req.sampling_params.data_parallel_rank is not None:
            r = self.replicas[req.sampling_params.data_parallel_rank]
            self.placements.record(r.index, None)
            return r
        pulling = [0] * len(self.replicas)  # P/D requests placed here, still waiting for their KV
        if self.pd is not None and self.pd.consumer is not None:
            for p in self.pd.consumer.pending.values():
                if p.request.dp_rank is not None:
                    pulling[p.request.dp_rank] += 1
        load = {r.index: r.num_unfinished + pulling[r.index] for r in self.replicas}
        least = min(load.values())
        ok = [r for r in self.replicas if load[r.index] <= least + PREFIX_LOAD_SLACK]

        hit_tokens: dict[int, int] = {}

        def score(r: EngineReplica) -> float:
            if req is None or r.prefix_cache is None:
                return 0.0
            hit = r.prefix_cache.lookup(req)
            hit_tokens[r.index] = hit.num_tokens
            tpp = r.kv.group("mla").tokens_per_page
            off = sum(1 for b in hit.blocks.get("mla", []) if b == 0) * tpp  # host-only MLA pages (HiSparse)
            ext = hit.num_external_tokens  # from the offload tier
            return hit.num_tokens - 0.5 * (off + ext)

        placed = self.placements.placed
        chosen = min(ok, key=lambda r: (-score(r), load[r.index], r.pool.usage(), placed[r.index], r.index))
        if req is not None:
            self.placements.record(chosen.index, hit_tokens.get(chosen.index, 0))
        return chosen

    def replica_of(self, request_id: str) -> EngineReplica | None:
        """The replica serving the live request `request_id`, or None."""
        return next((r for r in self.replicas if r.scheduler.get_request(request_id) is not None), None)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate (as `LLMEngine.add_request`) and queue on the least-loaded replica.
        Raises ValueError for bad params, a prompt that cannot be served or a duplicate id."""
        self._validate(prompt_token_ids, params)
        if self.has_request(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        with self._structured_admission(request_id, params):
            req = self._pd_request(request_id, prompt_token_ids, params, self.replicas[0].scheduler)
            if req is not None:
                self._queue(req)
                self._track_prompt_logprobs(req)

    def scheduler_of(self, request_id: str):
        rep = self.replica_of(request_id)
        return rep.scheduler if rep is not None else self.replicas[0].scheduler

    def _is_scheduled(self, request_id: str) -> bool:
        return self.replica_of(request_id) is not None

    def _queue(self, req: Request) -> None:
        rep = self.replicas[req.dp_rank] if req.dp_rank is not None else self.assign(req)
        rep.scheduler.add_request(req)

    def _local_prefix_tokens(self, req: Request) -> int:
        rep = self.assign(req)  # placed now: the pull skips what this replica holds
        req.dp_rank = rep.index
        return rep.prefix_cache.lookup(req).num_tokens if rep.prefix_cache is not None else 0

    def abort(self, request_id: str, finished_reason: str = "abort") -> RequestOutput | None:
        """Abort a waiting or running request on its replica (as `LLMEngine.abort`); the other
        replicas are untouched."""
        self.structured.remove(request_id)
        pulled = self._pd_abort(request_id, finished_reason)
        if pulled is not None:
            return pulled
        rep = self.replica_of(request_id)
        if rep is None:
            if finished_reason not in ("abort", "stop"):
                raise ValueError(f"finished_reason must be 'abort' or 'stop', got {finished_reason!r}")
            return None
        req = rep.scheduler.get_request(request_id)
        self._prompt_logprob_requests.pop(request_id, None)
        out = rep.scheduler.abort(request_id, finished_reason)
        if out is not None:
            rec = StepRecord(is_step=False)
            rec.finished.append(self._finished_stats(req, time.monotonic()))
            self._emit(rec)
        self._end_step()
        return out

    def has_unfinished_requests(self) -> bool:
        return (any(r.scheduler.has_unfinished_requests() for r in self.replicas) or self.is_waiting_for_remote_kv()
                or self._in_flight is not None)

    # Asynchronous scheduling's hooks (`serving.async_scheduling.AsyncStepMixin`): every replica's
    # scheduler schedules step n+1 while step n runs; one stacked step for all of them.
    def _schedulers(self) -> list:
        return [r.scheduler for r in self.replicas]

    def _dispatch_step(self, scheds, prev, defer_sampling: bool = False):
        return self.runner.dispatch_replicas(scheds, [r.kv for r in self.replicas], prev, defer_sampling)

    def _finish_step(self, step) -> list[dict[str, list[int]]]:
        return self.runner.finish_replicas(step, overlapped=True)

    def step(self) -> list[RequestOutput]:
        """Schedule every replica, run one jitted step for all, apply each replica's tokens.
        Returns the merged outputs (replica 0's first). With asynchronous scheduling the outputs
        are those of the step dispatched by the previous call (`serving/async_scheduling.py`)."""
        if self.async_scheduling and self.drafter_override is None:
            return self._step_async()
        t0 = time.perf_counter()
        pd_outs = self._pd_tick()
        preempted_before = sum(r.scheduler.num_preemptions_total for r in self.replicas)
        scheds = [r.scheduler.schedule() for r in self.replicas]
        if all(s.is_empty for s in scheds):
            self._end_step()
            return pd_outs
        try:
            self._structured_masks(scheds)
            self._pd_writes()
            sampled = self.runner.execute_replicas(scheds, [r.kv for r in self.replicas])
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
            return self._fail_step([(r.scheduler, s) for r, s in zip(self.replicas, scheds)], e)
        outs: list[RequestOutput] = list(pd_outs)
        per_replica = []
        recomputed = 0
        drafts = self.runner.last_drafts if self.drafts is not None else None
        for r, (rep, sched, toks) in enumerate(zip(self.replicas, scheds, sampled)):
            if self.hisparse is not None:
                sched, toks, kept = truncate_step(sched, toks, self.runner.last_truncated[r])
                recomputed += self.hisparse.policies[r].observe_step(kept)
                scheds[r] = sched
            o = rep.scheduler.update_from_output(sched, toks, drafts) if not sched.is_empty else []
            self._structured_advance(o)
            self._override_drafts(sched)
            self._attach_logprobs(o)
            per_replica.append(o)
            outs.extend(o)
        spec_step = self._observe_drafts(*scheds)
        self._after_offload()
        self._end_step()
        hot_stats = self.hisparse.device.last_stats if self.hisparse is not None else None
        st = self.runner.last
        host = (time.perf_counter() - t0) - st.device_s
        self.num_steps += 1
        self.host_overhead_s += host
        logger.debug("step %d: %d tokens over %d replicas (bucket %d each), host %.2f ms, device %.2f ms",
                     self.num_steps, st.num_tokens, len(self.replicas), st.padded_tokens // len(self.replicas),
                     1e3 * host, 1e3 * st.device_s)
        if self.stat_loggers:
            preempted = sum(r.scheduler.num_preemptions_total for r in self.replicas) - preempted_before
            rec = StepRecord(num_preemptions=preempted, num_scheduled_tokens=st.num_tokens, host_s=host,
                             device_s=st.device_s)
            if hot_stats is not None:
                rec.hisparse_hits, rec.hisparse_misses, _, rec.hisparse_h2d_bytes = hot_stats
                rec.hisparse_recomputed_rows = recomputed
            rec.spec_decoding = spec_step
            for sched, o in zip(scheds, per_replica):
                self._timing(sched, o, rec)
            self._emit(rec)
        return outs

    # ------------------------------------------------------------------ statistics
    def _prefix_cache_totals(self) -> tuple[int, int]:
        return (sum(r.prefix_cache.queries for r in self.replicas), sum(r.prefix_cache.hits for r in self.replicas))

    def _external_prefix_totals(self) -> tuple[int, int]:
        return (sum(r.prefix_cache.external_queries for r in self.replicas),
                sum(r.prefix_cache.external_hits for r in self.replicas))

    def audit(self) -> list[str]:
        """Invariant violations of every replica (prefixed "replica r: ") and request ids live on
        more than one replica (empty when sound)."""
        problems = [f"replica {r.index}: {p}" for r in self.replicas for p in r.scheduler.audit()]
        if self.offload is not None:
            problems += self.offload.audit()
        if self.pd is not None and self.pd.producer is not None:
            problems += self.pd.producer.audit()
        seen: dict[str, int] = {}
        for r in self.replicas:
            for rid in r.scheduler.requests:
                if rid in seen:
                    problems.append(f"request {rid!r} lives on replicas {seen[rid]} and {r.index}")
                seen[rid] = r.index
        return problems
