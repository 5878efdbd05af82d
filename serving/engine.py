"""The synchronous engine core: scheduler + block pool + model runner, one `step()` at a time.

    engine = build_engine(EngineArgs(model="/path/to/ckpt"))   # serving.engine_factory
    engine.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

All bookkeeping (scheduler, pool, block tables) is host-side Python; all compute is one jitted
step per call (serving/runner.py). `audit()` checks the pool and table invariants.
"""

from __future__ import annotations

import logging
import math
import time

import jax

from glm53.tokenizer import tokenizer_vocab_size
from serving.async_scheduling import AsyncStepMixin
from serving.block_pool import BlockPool
from serving.engine_args import (  # noqa: F401 (CPU_KV_CACHE_BYTES, EngineArgs, num_kv_blocks: re-exported)
    CPU_KV_CACHE_BYTES,
    SKIP_PRECOMPILE_ENV,
    EngineArgs,
    num_kv_blocks,
    skip_precompile_requested,
)
from serving.engine_host_tiers import HostTiersMixin
from serving.engine_startup import load_engine_parts, log_engine_plan
from serving.engine_stats import EngineStatsMixin
from serving.faults import EngineDeadError
from serving.hisparse import build_hisparse, hisparse_config
from serving.hisparse.truncation import truncate_step
from serving.kv_cache import KVCacheGroupSpec, KVCacheManager
from serving.kv_events import build_kv_events
from serving.metrics import (
    EngineGauges,
    LoggingStatLogger,
    StepRecord,
)
from serving.pd.engine_mixin import PDEngineMixin
from serving.prefix_cache import PrefixCache
from serving.runner import ModelRunner
from serving.scheduler import Scheduler, SchedulerConfig
from serving.spec_decode import DraftController, SpecDecodingStats, SpeculativeConfig
from serving.structured_outputs.engine_mixin import StructuredOutputsMixin
from serving.types import InvalidRequestError, ReasoningTags, RequestOutput, SamplingParams
from sharding.mesh import ParallelLayout

logger = logging.getLogger(__name__)



class LLMEngine(EngineStatsMixin, HostTiersMixin, PDEngineMixin, AsyncStepMixin, StructuredOutputsMixin):
    """Continuous-batching engine over one device (and its parallel layouts other than DP). Build
    one with `serving.engine_factory.build_engine(args)`."""

    data_parallel = False  # True for DataParallelEngine (from_args checks the layout against it)

    def __init__(self, model, layout, num_blocks: int, args: EngineArgs, eos_token_ids, model_path: str):
        self.args = args
        self.model_path = model_path
        self.config = model.cfg
        self.layout = layout
        self.pool = BlockPool(num_blocks, on_reuse=self._on_block_reuse)
        par = args.parallel
        self.parallel = (ParallelLayout.create(par) if par is not None and par.num_devices > 1 else None)
        dcp = par.decode_context_parallel_size if self.parallel is not None else 1
        # Under DCP an engine page spans tokens_per_page x dcp tokens (each rank stores its share).
        groups = [KVCacheGroupSpec(g.name, g.tokens_per_page * dcp) for g in layout.groups]
        caps = {g.name: math.ceil(args.max_model_len / s.tokens_per_page) for g, s in zip(layout.groups, groups)}
        self.kv = KVCacheManager(self.pool, groups, caps)
        self.hisparse = None  # serving.hisparse.HiSparse when --attention-config has hisparse_config
        self.spec_config = SpeculativeConfig.from_dict(args.speculative_config)
        k = self.spec_config.num_speculative_tokens if self.spec_config is not None else 0
        self.spec_stats = SpecDecodingStats(k) if k else None  # since start-up
        self.drafts = DraftController(self.spec_config) if k else None
        # Tests and the benchmark's oracle row: `fn(request, n) -> n draft tokens` replaces the MTP
        # layer's drafts after each step (the device still drafts; these are what gets verified).
        self.drafter_override = None
        hs_config = hisparse_config(args.attention_config)
        self.offload = self._build_offload(layout, hs_config is not None)
        off_store = self.offload.store if self.offload is not None else None
        if hs_config is not None:
            self.hisparse = build_hisparse(hs_config, self.kv, layout, model.cfg, args, self._on_host_block_reuse,
                                           offload=off_store, num_speculative_tokens=k, parallel=self.parallel)
            self.prefix_cache = self.hisparse.prefix_cache
            policy = self.hisparse.policy
        else:
            self.prefix_cache = PrefixCache(self.kv, offload=off_store) if args.enable_prefix_caching else None
            policy = None
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len),
            self.kv, eos_token_ids, self.prefix_cache, policy, drafts=self.drafts)
        self.runner = ModelRunner(model, layout, num_blocks, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, seed=args.seed,
                                  max_logprobs=args.max_logprobs, parallel=self.parallel,
                                  cuda_graph_sizes=args.cuda_graph_sizes,
                                  precompile_token_paddings=args.precompile_token_paddings,
                                  sampling_vocab_size=tokenizer_vocab_size(model_path),
                                  hisparse=self.hisparse.device if self.hisparse is not None else None,
                                  offload=self.offload, num_speculative_tokens=k)
        self.pd = self._build_pd(model.cfg, num_blocks, [(0, self.scheduler, self.kv, self.pool)])
        self.kv_events = build_kv_events(args.kv_events_config, [self.prefix_cache])
        self.async_scheduling = self._async_scheduling(args)
        self.eos_token_ids = tuple(eos_token_ids)
        self._structured_init(model_path, model.cfg.vocab_size, eos_token_ids, args.structured_outputs_config)
        self.num_steps = 0
        self.host_overhead_s = 0.0
        self.gauges = EngineGauges(lambda: self.scheduler.num_requests_running,
                                   lambda: self.scheduler.num_requests_waiting,
                                   lambda: self.scheduler.kv_cache_usage,
                                   self.hisparse.gauges() if self.hisparse is not None else None,
                                   self.offload.usage if self.offload is not None else None,
                                   num_speculative_tokens=k, kv_events=self.kv_events)
        self.stat_loggers: list = []
        if not args.disable_log_stats:
            self.stat_loggers.append(LoggingStatLogger(self.gauges, args.log_stats_interval_s))
        self._prefix_counts = (0, 0)
        self._offload_counts = (0, 0, 0, 0, 0)  # external queries and hits, pages stored, loaded, skipped

    def _async_scheduling(self, args: EngineArgs) -> bool:
        """`--async-scheduling` (True, or None: the default) turns asynchronous scheduling on for
        every engine (every feature schedules asynchronously: docs/async_scheduling.md);
        `--no-async-scheduling` (False) leaves it off. Logs which."""
        self.async_scheduling = False
        if args.async_scheduling is False:
            logger.info("asynchronous scheduling is off: each step's tokens are read before the next step is "
                        "scheduled (--async-scheduling, or EngineArgs(async_scheduling=True), turns it on)")
            return False
        self.set_async_scheduling(True)
        logger.info("asynchronous scheduling: step n+1 is scheduled and dispatched before step n's tokens are read")
        return True

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch asynchronous scheduling on or off between workloads (the same compiled steps
        serve both). Raises RuntimeError while requests are unfinished."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_async_scheduling: requests are unfinished")
        self.async_scheduling = bool(enabled)
        for scheduler in self._schedulers():
            scheduler.async_scheduling = self.async_scheduling

    # Asynchronous scheduling's hooks (`serving.async_scheduling.AsyncStepMixin`).
    def _schedulers(self) -> list:
        return [self.scheduler]

    def _dispatch_step(self, scheds, prev, defer_sampling: bool = False):
        return self.runner.dispatch(scheds[0], self.kv, prev, defer_sampling)

    def _finish_step(self, step) -> list[dict[str, list[int]]]:
        return [self.runner.finish(step, overlapped=True)]

    def _after_dispatch(self) -> None:
        # HiSparse's write-through copies and the connector's stores and loads are ordered with
        # every later program through the arena and the host pool (serving/async_scheduling.py,
        # the page rule): complete, file and release them now.
        if self.hisparse is not None:
            for policy in self.hisparse.policies:
                policy.complete_copies()
        self._after_offload()

    @classmethod
    def from_args(cls, args: EngineArgs, eos_token_ids=None, before_compile=None) -> LLMEngine:
        """Load the checkpoint, size the KV arena, build the engine and compile its step buckets.
        `serving.engine_factory.build_engine` picks the class (with `--data-parallel-size` > 1 a
        `serving.dp_engine.DataParallelEngine`, whose KV page count is per replica); called on
        `LLMEngine` itself with a data-parallel layout this raises ValueError naming it."""
        dp = args.parallel.data_parallel_size if args.parallel is not None else 1
        if dp > 1 and not cls.data_parallel:
            raise ValueError(f"{cls.__name__}.from_args with --data-parallel-size {dp}: build the engine with "
                             "serving.engine_factory.build_engine (a DataParallelEngine)")
        parts = load_engine_parts(args, eos_token_ids)
        engine = cls(parts.model, parts.layout, parts.num_blocks, args, parts.eos_token_ids, parts.path)
        log_engine_plan(engine, parts.layout, parts.num_blocks, args)
        if before_compile is not None:
            before_compile(engine)
        if skip_precompile_requested(args) and jax.process_count() == 1:
            logger.info("step buckets %s compile on first use (skip_precompile / %s)",
                        engine.runner.buckets, SKIP_PRECOMPILE_ENV)
            return engine
        if skip_precompile_requested(args):  # every process must have compiled before the first step
            logger.warning("skip_precompile ignored: a multi-process engine compiles its steps at start-up")
        secs = engine.runner.compile(progress=args.compile_progress)
        logger.info("compiled %d step buckets %s in %.1fs", len(engine.runner.buckets), engine.runner.buckets, secs)
        return engine

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError for bad params, a prompt that cannot be served or a
        duplicate id (the live request with that id is untouched)."""
        self._validate(prompt_token_ids, params)
        if self.has_request(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        with self._structured_admission(request_id, params):
            req = self._pd_request(request_id, prompt_token_ids, params, self.scheduler)
            if req is not None:
                self.scheduler.add_request(req)
                self._track_prompt_logprobs(req)

    @property
    def effective_max_model_len(self) -> int:
        """Most tokens (prompt + output) one request may reach: `--max-model-len`, or fewer when
        the KV cache bounds one request below it (Hybrid HiSparse on a small pool:
        `Scheduler.max_request_tokens`; the least over data-parallel replicas). The API server
        checks requests against it and reports it as the model's context length."""
        return min(s.max_request_tokens for s in self._schedulers())

    def max_model_len_note(self) -> str:
        """"" when `effective_max_model_len` is `--max-model-len`; otherwise a sentence naming both,
        what bounds a request and the setting that would raise it (appended to length errors)."""
        eff = self.effective_max_model_len
        if eff >= self.args.max_model_len:
            return ""
        return (f" This engine's KV cache holds at most {eff} tokens (prompt and output) of one request "
                f"although --max-model-len is {self.args.max_model_len}"
                f"{self._schedulers()[0].policy.capacity_note()}.")

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine-level checks of `add_request` (ValueError with the reason)."""
        params.validate()
        dp = self.args.parallel.data_parallel_size if self.args.parallel is not None else 1
        rank = params.data_parallel_rank
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < dp):
            raise InvalidRequestError(f"X-data-parallel-rank {rank!r} is not a data-parallel rank of this engine "
                                      f"(0…{dp - 1})", "X-data-parallel-rank")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.args.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; this model's maximum context length is "
                             f"{self.args.max_model_len} (--max-model-len), which must also leave room for output")
        eff = self.effective_max_model_len  # --max-model-len, or less when the KV cache bounds a request
        if params.max_tokens is not None and n + params.max_tokens > eff:
            if eff < self.args.max_model_len:
                raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the {eff} tokens "
                                 f"one request may reach on this engine.{self.max_model_len_note()}")
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum context "
                             f"length {self.args.max_model_len}")
        if params.logprobs is not None and params.logprobs > self.args.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} exceeds the maximum {self.args.max_logprobs} "
                             "(--max-logprobs)")
        if params.prompt_logprobs is not None:
            self._validate_prompt_logprobs(params)
        vocab = self.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= int(t) < vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                      "logit_bias")
        tags = params.reasoning_tags
        if params.thinking_token_budget is not None and not isinstance(tags, ReasoningTags):
            raise InvalidRequestError("thinking_token_budget needs the model's think-block token ids "
                                      "(SamplingParams.reasoning_tags)", "thinking_token_budget")
        if params.thinking_token_budget is not None and not all(
                t is None or 0 <= int(t) < vocab for t in (tags.end_id, tags.start_id)):
            raise InvalidRequestError(f"the think-block token ids {tags} are outside the vocabulary [0, {vocab})",
                                      "thinking_token_budget")

    def _validate_prompt_logprobs(self, params: SamplingParams) -> None:
        """Refuse `prompt_logprobs` where this engine cannot compute them (InvalidRequestError
        naming the field): more than --max-logprobs, or with P/D's `kv_transfer_params` (a decode
        engine never computes the prompt)."""
        if params.prompt_logprobs > self.args.max_logprobs:
            raise InvalidRequestError(f"prompt_logprobs {params.prompt_logprobs} exceeds the maximum "
                                      f"{self.args.max_logprobs} (--max-logprobs)", "prompt_logprobs")
        if params.kv_transfer_params:
            raise InvalidRequestError("prompt_logprobs is not supported with kv_transfer_params (prefill/decode "
                                      "disaggregation: the decode engine does not compute the prompt)",
                                      "prompt_logprobs")

    def abort(self, request_id: str, finished_reason: str = "abort") -> RequestOutput | None:
        """Abort a waiting or running request (frees its pages); its final output, or None when
        the id is unknown or finished. finished_reason "stop" (a stop string matched in the
        front end) counts it under `vllm:request_success_total{finished_reason="stop"}`.
        Raises ValueError for a reason other than "abort" or "stop"."""
        self.structured.remove(request_id)
        pulled = self._pd_abort(request_id, finished_reason)
        if pulled is not None:
            return pulled
        req = self.scheduler.get_request(request_id)
        self._prompt_logprob_requests.pop(request_id, None)
        out = self.scheduler.abort(request_id, finished_reason)
        if out is not None and req is not None:
            rec = StepRecord(is_step=False)
            rec.finished.append(self._finished_stats(req, time.monotonic()))
            self._emit(rec)
        self._end_step()
        return out

    def _end_step(self) -> None:
        """After a step, an abort or a failed step: flush the host copies when idle, then publish
        the KV events of what changed (`--kv-events-config`)."""
        self._flush_if_idle()
        if self.kv_events is not None:
            self.kv_events.publish_step()

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.is_waiting_for_remote_kv()
                or self._in_flight is not None)

    def step(self) -> list[RequestOutput]:
        """Schedule, run one jitted step, apply its tokens. Returns the new request outputs
        (with `new_logprobs` for requests that asked for logprobs). With asynchronous scheduling
        the outputs are those of the step dispatched by the previous call
        (`serving/async_scheduling.py`)."""
        if self.async_scheduling and self.drafter_override is None:
            return self._step_async()
        t0 = time.perf_counter()
        pd_outs = self._pd_tick()
        preempted_before = self.scheduler.num_preemptions_total
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._end_step()
            return pd_outs
        try:
            self._structured_masks([sched])
            self._pd_writes()
            sampled = self.runner.execute(sched, self.kv)
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
            return self._fail_step([(self.scheduler, sched)], e)
        hot_stats, recomputed = None, 0
        if self.hisparse is not None:
            hot_stats = self.hisparse.device.last_stats
            sched, sampled, kept = truncate_step(sched, sampled, self.runner.last_truncated)
            recomputed = self.hisparse.policy.observe_step(kept)
        drafts = self.runner.last_drafts if self.drafts is not None else None
        outs = self.scheduler.update_from_output(sched, sampled, drafts)
        self._structured_advance(outs)
        self._override_drafts(sched)
        spec_step = self._observe_drafts(sched)
        self._after_offload()
        st = self.runner.last
        self._end_step()
        self._attach_logprobs(outs)
        host = (time.perf_counter() - t0) - st.device_s
        self.num_steps += 1
        self.host_overhead_s += host
        logger.debug("step %d: %d tokens (bucket %d), host %.2f ms, device %.2f ms", self.num_steps, st.num_tokens,
                     st.padded_tokens, 1e3 * host, 1e3 * st.device_s)
        if self.stat_loggers:
            rec = StepRecord(num_preemptions=self.scheduler.num_preemptions_total - preempted_before,
                             num_scheduled_tokens=st.num_tokens, host_s=host, device_s=st.device_s)
            if hot_stats is not None:
                rec.hisparse_hits, rec.hisparse_misses, _, rec.hisparse_h2d_bytes = hot_stats
                rec.hisparse_recomputed_rows = recomputed
            rec.spec_decoding = spec_step
            self._timing(sched, outs, rec)
            self._emit(rec)
        return pd_outs + outs

    def _override_drafts(self, sched) -> None:
        """`drafter_override` (tests, the benchmark's oracle): replace the drafts the step's
        requests carry into the next step."""
        if self.drafter_override is None:
            return
        for sr in sched.scheduled:
            if sr.request.spec_token_ids:
                sr.request.spec_token_ids = list(self.drafter_override(sr.request, len(sr.request.spec_token_ids)))

    def _fail_step(self, scheduled, error: BaseException) -> list[RequestOutput]:
        """A step raised: finish its requests with finish reason "error" (pages freed in every
        group), then go on when the device state is intact, else raise `EngineDeadError`.

        scheduled: `(scheduler, SchedulerOutput)` pairs of the failed step (one per replica).
        Returns the failed requests' final outputs (`error` set). See `serving/faults.py`.
        """
        logger.exception("engine step %d failed", self.num_steps + 1, exc_info=error)
        msg = f"engine step failed: {type(error).__name__}: {error}"
        lost = self.runner.device_state_lost()
        if not lost:
            # The step's write-through copies and connector transfers ran in their own programs
            # before it (or were not taken yet): complete them.
            if self.hisparse is not None:
                from serving.scheduler_output import SchedulerOutput

                for policy in self.hisparse.policies:
                    policy.after_update(SchedulerOutput())
            self._after_offload()
        outs, rec = [], StepRecord(is_step=False)
        now = time.monotonic()
        for scheduler, sched in scheduled:
            for sr in sched.scheduled:
                req = scheduler.get_request(sr.request_id)
                out = scheduler.abort(sr.request_id, "error")
                if out is None:
                    continue
                out.error = msg
                outs.append(out)
                self._prompt_logprob_requests.pop(sr.request_id, None)
                if req is not None:
                    rec.finished.append(self._finished_stats(req, now))
        self._structured_advance(outs)
        self._emit(rec)
        if lost:
            where = ("a step of the multi-process engine failed after its inputs went to the other processes"
                     if self.runner.step_in_flight else "the device state was lost in a failed step")
            raise EngineDeadError(f"{where} ({msg}); the engine cannot continue") from error
        self._end_step()
        return outs

    def audit(self) -> list[str]:
        """Invariant violations of the scheduler, the block tables and the pool (empty when sound),
        and of the offloading connector's host store."""
        errors = self.scheduler.audit()
        if self.offload is not None:
            errors += self.offload.audit()
        if self.pd is not None and self.pd.producer is not None:
            errors += self.pd.producer.audit()
        return errors
