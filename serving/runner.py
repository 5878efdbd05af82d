"""Model runner: turns a `SchedulerOutput` into flat arrays and calls one jitted step.

The step (`forward + sample`, `serving.step_program`) is compiled for a fixed set of token-count
buckets (`serving.step_buckets`) at start-up (with a progress bar); the KV arena is donated so it is
updated in place. A step's token count is padded up to the next bucket. Request rows are padded to
`max_num_seqs + 1` (the last row is the all-null padding row), block tables to the width that covers `max_model_len`. The step
first runs the scheduler's whole-page copies (`SchedulerOutput.page_copies`, copy-on-write of
prefix-cache pages), passed as two int32 arrays of fixed size padded with −1 (a loop over the
valid entries only, so a step without copies pays nothing).

The runner's other concerns live beside it: compiling and tracing the step programs
(`serving/runner_compile.py`), the host-memory transfer programs around a step — HiSparse's
write-through copies, the offloading connector's stores and loads (`serving/runner_transfers.py`)
— and data-parallel replicas' stacked steps (`serving/runner_replicas.py`).
"""

from __future__ import annotations

import logging
import math
import time
import zlib

import jax
import numpy as np
from flax import nnx

from glm53.batch import ForwardBatch
from glm53.kv_layout import KVCacheLayout, layout_has_mtp
from glm53.model import GlmForCausalLM
from glm53.parallel_batch import (
    empty_parallel_arena,
    pcp_reorder,
    shard_batch,
)
from kernels.mode import KERNEL_MODE_ENV, kernel_mode, use_kernels
from serving.arena_pages import ArenaPageIO
from serving.faults import STALL_SECONDS, FaultInjection, InjectedFault
from serving.hisparse.device_state import HiSparseDeviceState
from serving.kv_cache import KVCacheManager
from serving.penalties import step_penalties
from serving.prompt_logprobs import PromptLogprobRows, record, step_rows
from serving.runner_compile import StepCompileMixin
from serving.runner_replicas import ReplicaStepsMixin
from serving.runner_transfers import HostTransfersMixin
from serving.runner_variants import VariantPrecompileMixin
from serving.scheduler_output import SchedulerOutput
from serving.spec_decode.feed import spec_feed_plan
from serving.spec_decode.inputs import build_spec_batch
from serving.step_buckets import default_cuda_graph_sizes, token_buckets
from serving.step_inputs import (
    COPY_DST,
    COPY_SRC,
    NUM_SAMPLING,
    STEPS,
    WANT_LOGPROBS,
    StepInputs,
)
from serving.step_program import build_step_programs
from serving.step_stats import InFlightStep, StepStats
from serving.types import TokenLogprobs
from sharding.context_parallel import pcp_chunk_order
from sharding.mesh import ParallelLayout
from sharding.rules import arena_shards, shard_params

logger = logging.getLogger(__name__)


def _host_input(x):
    """A host input as the jitted programs take it on one device: the numpy array itself."""
    return x


def _allowed(ids, lps) -> list[tuple[int, float]]:
    """Top alternatives as (id, logprob), without ids of probability 0 (-inf: ids a structured
    output's grammar forbids, or padding ids): logprobs are over the allowed ids only."""
    return [(int(a), float(b)) for a, b in zip(ids, lps) if b > -np.inf]


class ModelRunner(StepCompileMixin, VariantPrecompileMixin, HostTransfersMixin, ArenaPageIO, ReplicaStepsMixin):
    """Owns the parameters, the KV arena and the compiled steps.

    Args:
      model: the loaded model. layout: its KV arena layout. num_blocks: arena pages (incl. null).
      max_num_seqs / max_num_batched_tokens / max_model_len: the scheduler limits.
      cuda_graph_sizes: decode-sized token buckets compiled besides the prefill ones (None: the
        powers of two up to max_num_seqs, `default_cuda_graph_sizes`, times k + 1 under MTP
        speculation; () for none).
      precompile_token_paddings: the prefill-sized token buckets (None: 16·4^k; () for none
        besides max_num_batched_tokens; `token_buckets`).
      sampling_vocab_size: ids at or past it are never sampled nor reported in logprobs (the
        tokenizer's size when the checkpoint pads its vocabulary; `serving.sampling.mask_unreachable`).
        None: every id of the model's vocabulary.
      offload: the KV offloading connector (`serving.offload.Offload`) or None: its queued stores
        and the step's loads run before each step (`run_offload`).
      num_speculative_tokens: k > 0 runs MTP speculation: every step verifies the scheduled drafts
        (`serving.spec_decode.rejection`) and the MTP layer drafts k tokens per sampling request
        for the next step (`glm53.mtp.propose_drafts`), all inside the one jitted step; the layout
        must have the `mtp` KV group. `execute` then returns up to k + 1 tokens per request and
        `last_drafts` holds the next drafts.
    """

    def __init__(self, model: GlmForCausalLM, layout: KVCacheLayout, num_blocks: int, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, seed: int = 0, max_logprobs: int = 20,
                 parallel: ParallelLayout | None = None, cuda_graph_sizes=None, precompile_token_paddings=None,
                 hisparse: HiSparseDeviceState | None = None, sampling_vocab_size: int | None = None,
                 offload=None, num_speculative_tokens: int = 0):
        self.layout = layout
        self.spec_k = num_speculative_tokens
        if self.spec_k and not layout_has_mtp(layout, model.cfg):
            raise ValueError("MTP speculation needs a KV layout holding the MTP layer's rows (build_kv_layout(with_mtp=True))")
        self.last_drafts: dict[str, list[int]] = {}
        self.last_accepted: dict[str, int] = {}
        self.hisparse = hisparse
        self.offload = offload  # serving.offload.Offload (its stores' queues, its transfer programs)
        self.parallel = parallel
        self.graphdef, self.state = nnx.split(model)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        pcp = parallel.pcp if parallel is not None else 1
        if cuda_graph_sizes is None:
            cuda_graph_sizes = default_cuda_graph_sizes(max_num_seqs, 2 * pcp if pcp > 1 else 1)
            if self.spec_k:  # a decode step of B requests verifying k drafts each has B·(k + 1) rows
                cuda_graph_sizes = tuple(b * (self.spec_k + 1) for b in cuda_graph_sizes)
        self.buckets = token_buckets(max_num_batched_tokens, cuda_graph_sizes, precompile_token_paddings)
        self.compile_seconds: dict[int, float] = {}  # filled by `compile` (empty: compiled on first use)
        # The kernels every step program is traced with (kernels/mode.py: GLM53_KERNELS or a
        # `use_kernels` block around the engine's construction), fixed for the engine's life.
        self.kernel_mode = kernel_mode()
        if self.kernel_mode != "auto":
            logger.info("kernels: %s (%s)", self.kernel_mode, KERNEL_MODE_ENV)
        dcp = parallel.dcp if parallel is not None else 1  # under DCP an engine page spans tpp × dcp tokens
        self.widths = {g.name: math.ceil(max_model_len / (g.tokens_per_page * dcp)) for g in layout.groups}
        if parallel is None:
            # Committed to device memory (as the step returns it): see HiSparseDeviceState.hot.
            self.kv_arena = layout.empty_arena(num_blocks, jax.sharding.SingleDeviceSharding(
                jax.devices()[0], memory_kind="device"))
        else:
            bad = [b for b in self.buckets if parallel.pcp > 1 and b % (2 * parallel.pcp)]  # PCP splits 2·pcp chunks
            if bad:
                raise ValueError(f"--prefill-context-parallel-size {parallel.pcp} needs every token bucket to be a "
                                 f"multiple of {2 * parallel.pcp}; {bad} are not (--max-num-batched-tokens, "
                                 "--cuda-graph-sizes)")
            self.state = shard_params(self.state, parallel)
            self.kv_arena = empty_parallel_arena(layout, num_blocks, parallel)
        self.dp = parallel.dp if parallel is not None else 1  # attention replicas (serving/dp_engine.py)
        self.seed = seed
        self.max_logprobs = max_logprobs
        self.last = StepStats()
        self.last_logprobs: dict[str, list[TokenLogprobs]] = {}
        # HiSparse: requests whose last step dropped a hot-buffer selection → the position their
        # chunk is valid up to (`HiSparseDevice.truncations`); a list of such dicts per replica
        # after `execute_replicas`.
        self.last_truncated: dict[str, int] | list[dict[str, int]] = {}
        self.num_page_copies = 0  # whole-page copies run on the device so far
        self.num_hot_steps = 0  # HiSparse steps run with the hot path (some request held a hot lease)
        self._store_jobs: dict[int, list] = {}  # HiSparse copies `prepare` took, per replica
        self.faults: FaultInjection | None = FaultInjection.from_env()  # test hook (serving/faults.py)
        # Multi-host (serving/multihost): the leader's `step_sink(op, inputs)` sends each device
        # program's host inputs to the followers before it is dispatched ("step": `StepInputs`;
        # "stores": HiSparse's copy lists); every process places host inputs as global arrays
        # replicated over the mesh (one value, the same on every process).
        self.step_sink = None
        self.steps_in_flight = 0  # the leader's steps sent to the followers and not read back yet
        self._last_sampled = None  # the sampled tokens of the step dispatched last (the token feed)
        self._last_out = None  # all outputs of that step (MTP's feed reads its accepted counts and drafts)
        if jax.process_count() > 1:
            if parallel is None or parallel.mesh.size != jax.device_count():
                raise ValueError(f"a multi-process engine needs a parallel layout over all {jax.device_count()} "
                                 "devices of its processes (--tensor-parallel-size, --data-parallel-size, ...)")
            if hisparse is not None and hisparse.mechanism == "callback":
                raise ValueError("Hybrid HiSparse with hisparse_config.host_gather \"callback\" keeps one numpy host pool "
                                 "per process, which a multi-process engine cannot share; set host_gather "
                                 "\"memory_kind\"")
            if offload is not None and offload.transfer.mechanism == "callback":
                raise ValueError("the offloading connector with the \"callback\" host mechanism keeps one numpy page "
                                 "store per process, which a multi-process engine cannot share")
            replicated = jax.sharding.NamedSharding(parallel.mesh, jax.sharding.PartitionSpec())
            self._put = lambda x: jax.device_put(np.asarray(x), replicated)
            if offload is not None:
                offload.transfer.put = self._put
        else:
            # Host inputs go to the jitted programs as numpy arrays: the dispatch transfers them
            # (≈ 20 µs for a step's fifteen arrays on the CPU, against ≈ 0.7 ms through
            # `jnp.asarray` one by one).
            self._put = _host_input
        reachable = model.cfg.vocab_size if sampling_vocab_size is None else min(sampling_vocab_size,
                                                                                 model.cfg.vocab_size)
        self.sampling_vocab_size = reachable
        k = max(1, min(max_logprobs, reachable))

        # A step copies at most one page per group for each request it admits. Under a parallel
        # layout the arena holds one `num_blocks` shard per (replica, DCP rank), rows
        # [s * num_blocks, (s + 1) * num_blocks) with s = replica * dcp + rank (replica-major);
        # a replica's engine page is copied in each of its own DCP shards.
        self.num_blocks = num_blocks
        self.arena_shards = arena_shards(parallel) if parallel is not None else 1
        self.max_page_copies = max_num_seqs * len(layout.groups) * self.arena_shards

        self._feeds: dict = {}  # sharding → the jitted token feed (`_feed_tokens`)
        # (variant, bucket, plain program): step variants compiled on first use so far ("masked": the
        # step with structured outputs' mask; "forward-only": the step without its sampler).
        self._first_use_programs: set = set()
        self.num_first_use_compiles = 0  # step variants compiled on the engine thread (logged)
        self._ids_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        # The step gets the state's leaves, flattened once here (`build_step_programs`).
        self._state_leaves, state_def = jax.tree.flatten(self.state)
        self._step, self._store_only, self._forward, self._sample = build_step_programs(
            self.graphdef, layout, parallel, hisparse, self.spec_k, reachable, k, state_def)
        self.num_deferred_samples = 0  # steps whose sampler ran after the previous step was read back

    def _place(self, batch: ForwardBatch) -> ForwardBatch:
        """Host batch → the step's batch argument: on one device the numpy arrays themselves (the
        dispatch transfers them); under a layout the PCP load-balanced token order on the mesh."""
        if self.parallel is None:
            # The input ids are committed to the device (the rest stays numpy): a fed step's ids
            # (`_feed_tokens`) are a device array of the same sharding, so both hit one program.
            # (Under MTP every step's ids, positions, slots, step counters and `SpecBatch` go through
            # a program of their own first: `_spec_inputs`.)
            if self.spec_k:
                return batch
            batch.input_ids_T = jax.device_put(batch.input_ids_T, self._ids_sharding)
            return batch
        if self.dp > 1:  # already stacked by `stack_replicas` (which reorders for PCP)
            return shard_batch(batch, self.parallel)
        return shard_batch(pcp_reorder(batch, self.parallel.pcp), self.parallel)

    # ------------------------------------------------------------------ step
    def bucket(self, num_tokens: int) -> int:
        """The smallest token bucket holding `num_tokens`. Raises ValueError past the largest."""
        T = next((b for b in self.buckets if b >= num_tokens), None)
        if T is None:
            raise ValueError(f"step of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")
        return T

    def prepare(self, sched: SchedulerOutput, kv: KVCacheManager, num_tokens: int | None = None,
                replica: int = 0):
        """Host side: flat padded arrays for the scheduled requests of one replica.

        num_tokens: pad to this many tokens (default: the bucket of the step's token count).
        replica: the DP replica (its page copies go to its own arena shards)."""
        T = self.bucket(sched.num_scheduled_tokens) if num_tokens is None else num_tokens
        B = self.max_num_seqs + 1
        pad_row = B - 1
        ids = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        req = np.full(T, pad_row, np.int32)
        slots = {g: np.full(T, -1, np.int32) for g in self.widths}
        logits_idx = np.zeros(B, np.int32)
        temperature = np.zeros(B, np.float32)
        top_p = np.ones(B, np.float32)
        top_k = np.zeros(B, np.int32)
        min_p = np.zeros(B, np.float32)
        seeds = np.zeros(B, np.uint32)
        steps = np.zeros(B, np.int32)
        rids: list[str | None] = [None] * B
        off = 0
        for i, sr in enumerate(sched.scheduled):
            r = sr.request
            n = sr.num_new_tokens
            p = sr.positions
            toks = sr.token_ids  # shorter by one for an output placeholder (async scheduling: `feed_sources`)
            ids[off:off + len(toks)] = toks
            pos[off:off + n] = p
            req[off:off + n] = i
            for g in self.widths:
                slots[g][off:off + n] = kv.slot_mapping(r.request_id, g, p)
            rids[i] = r.request_id
            logits_idx[i] = off + n - 1
            sp = r.sampling_params
            temperature[i] = sp.temperature
            top_p[i] = sp.top_p
            top_k[i] = min(sp.top_k, np.iinfo(np.int32).max)  # any k past the vocabulary keeps it all
            min_p[i] = sp.min_p
            seed = sp.seed if sp.seed is not None else zlib.crc32(r.request_id.encode()) ^ self.seed
            seeds[i] = np.uint32(seed & 0xFFFFFFFF)
            steps[i] = len(r.output_token_ids) + r.num_output_placeholders
            off += n
        tables = {g: kv.block_table_array(rids, g, w) for g, w in self.widths.items()}
        batch = ForwardBatch(ids, pos, req, slots, tables, logits_idx)
        if self.hisparse is not None:
            batch.hot, jobs = self.hisparse.inputs(sched, B, self.widths["mla"], replica)
            self._store_jobs[replica] = jobs
        copies = np.full((2, self.max_page_copies), -1, np.int32)
        if sched.page_copies:
            pairs = np.asarray(sched.page_copies, np.int32).T  # [2, C] engine block ids
            per = self.arena_shards // self.dp  # a replica's DCP shards
            shards = replica * per + np.arange(per, dtype=np.int32)
            pairs = (pairs[:, None, :] + (shards * self.num_blocks)[None, :, None]).reshape(2, -1)
            if pairs.shape[1] > self.max_page_copies // self.dp:
                raise ValueError(f"{len(sched.page_copies)} page copies in one step, at most "
                                 f"{self.max_page_copies // self.arena_shards}")
            copies[:, : pairs.shape[1]] = pairs
            self.num_page_copies += len(sched.page_copies)
        want_lp = np.bool_(any(sr.sample and sr.request.sampling_params.logprobs is not None
                               for sr in sched.scheduled))
        return batch, (temperature, top_p, top_k, min_p, seeds, steps, want_lp, *copies)

    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> dict[str, list[int]]:
        """Run one step; returns sampled tokens for the requests whose chunk samples.

        For sampling requests whose `sampling_params.logprobs` is not None, `last_logprobs`
        then maps the request id to its sampled tokens' `TokenLogprobs` (top alternatives cut
        to the requested number), one per token."""
        return self.finish(self.dispatch(sched, kv))

    def dispatch(self, sched: SchedulerOutput, kv: KVCacheManager, prev: InFlightStep | None = None,
                 defer_sampling: bool = False) -> InFlightStep:
        """Prepare and dispatch one step without waiting for it (`finish` reads its outputs).

        prev: the step still in flight (asynchronous scheduling): a scheduled request with an
        output placeholder gets, as its input token, what `prev` samples for it, taken on the
        device (`feed_sources`). defer_sampling: dispatch the forward pass only; the sampler runs
        at `sample_deferred` (structured outputs' masks computed after `prev` was read back).
        Raises ValueError when a placeholder's request is not a sampling request of `prev`."""
        t0 = time.perf_counter()
        batch, extra = self.prepare(sched, kv)
        feed_src = self._feed(prev, [sched], batch.input_ids_T.shape[0])
        self._dispatch_stores()
        self._maybe_fault()
        if self.offload is not None:
            self.run_offload([sched.page_loads])
        sp = spec_feed = None
        if self.spec_k:
            sp = build_spec_batch(sched, batch.input_ids_T.shape[0], self.max_num_seqs + 1, self.spec_k,
                                  sched.num_draft_steps)
            feed_src, spec_feed = None, feed_src
        pen = None if defer_sampling else self._step_penalties([sched])
        return self._launch([sched], StepInputs(batch, extra, sp, self._step_bitmask([sched]), feed_src, pen,
                                                spec_feed=spec_feed), t0,
                            defer_sampling, self._prompt_rows([sched], batch.input_ids_T.shape[0]))

    def _prompt_rows(self, scheds: list[SchedulerOutput], num_tokens: int) -> PromptLogprobRows | None:
        """The step's prompt-logprob rows (`serving.prompt_logprobs.step_rows`) or None."""
        return step_rows(scheds, num_tokens, self.parallel.pcp if self.parallel is not None else 1)

    def _launch(self, scheds: list[SchedulerOutput], inputs: StepInputs, t0: float,
                defer_sampling: bool = False, prompt_rows: PromptLogprobRows | None = None) -> InFlightStep:
        """Dispatch prepared inputs (`run_inputs`) → the `InFlightStep` of `scheds` (one per DP
        replica; replica r's request rows start at r · (max_num_seqs + 1)). The outputs' device →
        host copies start as soon as the step ends; logprob outputs are dropped when no request
        asked for them. t0: when preparing the step began. defer_sampling: the forward pass
        only (the step's `out` is None until `sample_deferred`). prompt_rows: the step's
        prompt-logprob rows or None (`serving.prompt_logprobs`: their logprobs come with the step's
        forward pass, split or not)."""
        t1 = time.perf_counter()
        num_tokens = inputs.batch.input_ids_T.shape[0]
        want_lp = bool(inputs.extra[WANT_LOGPROBS])
        B = self.max_num_seqs + 1
        rows = {sr.request_id: r * B + i for r, s in enumerate(scheds) for i, sr in enumerate(s.scheduled) if sr.sample}
        # Penalties and logit biases run in the split sampler program where the step can be split
        # (one process, no speculation): a new list width then compiles the sampler, not the step.
        split = not defer_sampling and inputs.penalties is not None and self.can_defer_sampling
        if prompt_rows is not None:
            inputs.prompt_rows = prompt_rows.arrays
        if defer_sampling or split:
            logits, hs, prompt_out = self.run_inputs(inputs, forward_only=True)
            out = None
        else:
            out, hs, prompt_out = self.run_inputs(inputs)
        stats = (hs[0].stats_Z5, hs[0].first_drop_S) if hs is not None else None
        step = InFlightStep(list(scheds), None, stats, want_lp, rows, sum(s.num_scheduled_tokens for s in scheds),
                            num_tokens, t1 - t0, t1)
        if prompt_out is not None:
            step.prompt_logprobs = (prompt_rows, prompt_out)
        if defer_sampling:
            step.deferred = (logits, inputs.extra)
        elif split:
            self._keep_outputs(step, self._run_sampler(logits, inputs.extra, inputs.bitmask, inputs.penalties))
        else:
            self._keep_outputs(step, out)
        return step

    def _keep_outputs(self, step: InFlightStep, out: tuple) -> None:
        """Set `step.out` (logprob outputs dropped when no request asked for them) and start the
        device → host copies of its outputs (its prompt logprobs' too), which run as soon as the
        step ends."""
        if not step.want_lp:
            out = out[:3] + (None,) * 3 if self.spec_k else out[:1] + (None,) * 3
        step.out = out
        if self.step_sink is None and jax.process_count() == 1:
            prompt_out = step.prompt_logprobs[1] if step.prompt_logprobs is not None else None
            for x in jax.tree.leaves((out, step.stats, prompt_out)):
                x.copy_to_host_async()

    @property
    def can_defer_sampling(self) -> bool:
        """True when a step can be dispatched without its sampler (`dispatch(defer_sampling=True)`):
        one process (a multi-process leader sends whole steps) and no speculation."""
        return self._forward is not None and self.step_sink is None and jax.process_count() == 1

    def sample_deferred(self, step: InFlightStep) -> None:
        """Run the sampler of a step dispatched with `defer_sampling` on its logits (still on the
        device), with structured outputs' masks as its schedules hold them now
        (`SchedulerOutput.grammar_bitmask`) and the penalties' output counts as its requests
        hold them now (`serving.penalties`) → `step.out`. The next step's token feed reads these
        outputs. Raises RuntimeError for a step that was not deferred or was sampled already."""
        if step.deferred is None:
            raise RuntimeError("sample_deferred: the step was dispatched with its sampler")
        logits, extra = step.deferred
        step.deferred = None
        out = self._run_sampler(logits, extra, self._step_bitmask(step.scheds), self._step_penalties(step.scheds))
        self.num_deferred_samples += 1
        self._keep_outputs(step, out)

    def _run_sampler(self, logits, extra: tuple, bitmask: np.ndarray | None, pen: tuple | None) -> tuple:
        """The split sampler program on a forward pass's logits (on the device) → its outputs; the
        next step's token feed reads them. extra: the step's `StepInputs.extra`; bitmask, pen: the
        step's masks and penalties (`StepInputs`), or None."""
        put = self._put
        if pen is None:
            out = self.call_variant(("sample", bitmask is not None), self._sample, logits,
                                    *map(put, extra[:NUM_SAMPLING]), *(() if bitmask is None else (put(bitmask),)))
        else:
            out = self.call_variant(("sample", bitmask is not None, f"penalized{pen[0].shape[-1]}"), self._sample, logits,
                                    *map(put, extra[:NUM_SAMPLING]), None if bitmask is None else put(bitmask),
                                    tuple(map(put, pen)))
        self._last_sampled = out[0]
        return out

    def _feed(self, prev: InFlightStep | None, scheds: list[SchedulerOutput], num_tokens: int):
        """The token feed of a step dispatched while `prev` is in flight (`StepInputs.feed_src`):
        None, or int32 [dp · num_tokens] in the placed token order, the row of `prev`'s sampled
        tokens each placeholder row takes (−1 elsewhere). `num_tokens` is one replica's bucket;
        replica r's rows are the r-th slice (`stack_replicas`) and under PCP each slice is in the
        load-balanced order the step's tokens are placed in (`glm53.parallel_batch.pcp_reorder`).
        Raises RuntimeError when `prev` is not the step dispatched last (the feed reads the
        outputs of that one)."""
        if prev is None:
            return None
        if self.spec_k:
            return self._spec_feed(prev, scheds, num_tokens)
        srcs = [self.feed_sources(s, num_tokens, prev.rows) for s in scheds]
        if all(src is None for src in srcs):
            return None
        if prev.out[0] is not self._last_sampled:
            raise RuntimeError("the token feed must read the step dispatched last")
        order = self._placed_order(num_tokens)
        return np.concatenate([np.full(num_tokens, -1, np.int32) if x is None else x[order] for x in srcs])

    def _placed_order(self, num_tokens: int):
        """The host token rows of one replica's bucket in the order the step places them (PCP's
        load-balanced order, `glm53.parallel_batch.pcp_reorder`), as an index."""
        pcp = self.parallel.pcp if self.parallel is not None else 1
        return pcp_chunk_order(num_tokens, pcp) if pcp > 1 else slice(None)

    def _spec_feed(self, prev: InFlightStep, scheds: list[SchedulerOutput], num_tokens: int):
        """MTP's feed of a step dispatched while `prev` is in flight (`StepInputs.spec_feed`):
        None, or `serving.spec_decode.feed.spec_feed_plan`'s six arrays for all replicas (stacked
        replica-major), the token rows' source and index in the placed order, the MTP inputs' and
        request rows' in the host's. Raises RuntimeError when `prev` is not the step dispatched last."""
        B = self.max_num_seqs + 1
        plans = [spec_feed_plan(s, num_tokens, B, prev.rows) for s in scheds]
        if all(p is None for p in plans):
            return None
        if prev.out[0] is not self._last_sampled:
            raise RuntimeError("the token feed must read the step dispatched last")
        order = self._placed_order(num_tokens)
        none = (np.full(num_tokens, -1, np.int32),) * 4 + (np.full(B, -1, np.int32),) * 2
        plans = [none if p is None else p for p in plans]
        return tuple(np.concatenate([p[i][order] if i < 2 else p[i] for p in plans]) for i in range(6))

    @staticmethod
    def feed_sources(sched: SchedulerOutput, num_tokens: int, prev_rows: dict) -> np.ndarray | None:
        """int32 [num_tokens]: for each token row fed from the device (a request's output
        placeholder: its token list is one short), the previous step's output row that samples
        it; −1 elsewhere. None when no row is fed. Raises ValueError when a placeholder's request
        is not among `prev_rows`."""
        src, off = None, 0
        for sr in sched.scheduled:
            n = sr.num_new_tokens
            missing = n - len(sr.token_ids)
            if missing:
                row = prev_rows.get(sr.request_id)
                if missing != 1 or row is None:
                    raise ValueError(f"request {sr.request_id!r}: {missing} input tokens not known, and the step "
                                     "in flight does not sample them")
                if src is None:
                    src = np.full(num_tokens, -1, np.int32)
                src[off + n - 1] = row
            off += n
        return src

    def finish(self, step: InFlightStep, overlapped: bool = False) -> dict[str, list[int]]:
        """Wait for a dispatched step and read its outputs back → sampled tokens per sampling
        request (as `execute`); sets `last`, `last_logprobs`, `last_truncated` (HiSparse) and,
        under MTP, `last_drafts` / `last_accepted`. `last.device_s` is the time from dispatch
        until the outputs were on the host, or with `overlapped` (the host did other work since
        the dispatch: asynchronous scheduling) the time this call waited for them."""
        sched = step.sched
        out, truncated = self._fetch_outputs(step, overlapped)
        self.last_truncated = truncated[0]
        if self.spec_k:
            toks, acc, drafts, tok_lp, top_ids, top_lp = out
        else:
            acc = drafts = None
            toks, tok_lp, top_ids, top_lp = out
        if self.spec_k:
            self.last_drafts, self.last_accepted = {}, {}
            return self._collect_spec(sched, toks, acc, drafts, tok_lp, top_ids, top_lp)
        return self._collect(sched, toks, tok_lp, top_ids, top_lp)

    def _fetch_outputs(self, step: InFlightStep, overlapped: bool) -> tuple[tuple, list[dict[str, int]]]:
        """Wait for `step` and read its sampler outputs back → (them, as numpy; each replica's
        HiSparse truncations, request id → valid positions). Records HiSparse's counters and
        sets `last` (see `finish`) and an empty `last_logprobs`."""
        t1 = time.perf_counter()
        out, stats = jax.device_get((step.out, step.stats))
        if step.prompt_logprobs is not None:
            plan, prompt_out = step.prompt_logprobs
            record(plan, jax.device_get(prompt_out))
        self._read_back()
        truncated = [{} for _ in step.scheds]
        if self.hisparse is not None:
            self.hisparse.record(stats[0] if stats is not None else (0, 0, 0, 0, 0))
            if stats is not None:
                truncated = [self.hisparse.truncations(s, stats[1], r) for r, s in enumerate(step.scheds)]
                self.hisparse.check_drops(stats[0], truncated)
        t2 = time.perf_counter()
        # Synchronous: dispatch → outputs on the host. Asynchronous: the wait for them.
        self.last = StepStats(step.num_tokens, step.padded_tokens, step.prepare_s,
                              t2 - (t1 if overlapped else step.dispatched))
        self.last_logprobs = {}
        return out, truncated

    def run_inputs(self, inputs: StepInputs, forward_only: bool = False):
        """Dispatch the jitted step on prepared host inputs → (sampler outputs, HiSparse state or
        None, the prompt logprobs of `inputs.prompt_rows` or None), all still on the device; with
        `forward_only` (one process, no speculation) the forward pass alone → (its logits, HiSparse
        state or None, prompt logprobs or None), for `sample_deferred`. The engine's `execute` / `execute_replicas` call it after
        `prepare`; a multi-host follower calls it with the inputs the leader sent
        (`serving.multihost`). With `step_sink` set (the multi-host leader), the inputs are sent
        to the followers first, and the step counts in `steps_in_flight` until the caller has
        read its outputs back: a step that fails in between leaves the processes in unknown
        states. `inputs.feed_src` (asynchronous scheduling): the input ids of rows with src ≥ 0
        are taken on the device from the sampled tokens of the step this process dispatched
        last (`_feed_tokens`; every process keeps its own copy, `_last_sampled`)."""
        batch, extra, sp = inputs.batch, inputs.extra, inputs.spec
        # HiSparse without a hot lease in the step (no pressure): the plain program, which is the
        # non-HiSparse step (no resolver, no hot state, no host pool), so the engine performs as
        # without HiSparse until pressure arrives.
        # (A follower receives `hot` already None for the plain program.)
        active = self.hisparse is not None and batch.hot is not None and bool(batch.hot.active)
        hs_args = self._hisparse_args() if active else None
        if hs_args is None:
            batch.hot = None
        else:
            self.num_hot_steps += 1
        if forward_only and not self.can_defer_sampling:
            raise RuntimeError("a forward-only step needs one process and no speculation")
        if self.step_sink is not None:
            self.steps_in_flight += 1
            self.step_sink("step", inputs)
        put = self._put
        placed = self._place(batch)
        extra_args = [put(x) for x in extra]
        sp_args = None if sp is None else jax.tree.map(put, sp)
        if (inputs.feed_src is not None or inputs.spec_feed is not None) and self._last_sampled is None:
            raise RuntimeError("a fed step needs a previous step's outputs")
        if inputs.feed_src is not None:
            placed.input_ids_T = self._feed_tokens(placed.input_ids_T, put(inputs.feed_src), self._last_sampled)
        if sp is not None:
            placed, extra_args[STEPS], sp_args = self._spec_inputs(placed, extra_args[STEPS], sp_args, inputs.spec_feed)
        bitmask = None if inputs.bitmask is None else put(inputs.bitmask)
        pen = None if forward_only or inputs.penalties is None else tuple(map(put, inputs.penalties))
        plp = None if inputs.prompt_rows is None else tuple(map(put, inputs.prompt_rows))
        parts = ["forward-only"] if forward_only else (
            ([] if bitmask is None else ["masked"]) + ([] if pen is None else [f"penalized{pen[0].shape[-1]}"]))
        variant = "+".join(parts + ([] if plp is None else ["prompt-logprobs"])) or None
        key = (variant, batch.input_ids_T.shape[0], hs_args is None)
        t0 = time.perf_counter()
        with use_kernels(self.kernel_mode):  # a program traced now uses the engine's kernels
            # A variant a background thread compiled (`serving.runner_variants`) runs its executable.
            if forward_only:
                res = self.call_variant(key, self._forward, self._state_leaves, placed, self.kv_arena,
                                        put(extra[COPY_SRC]), put(extra[COPY_DST]), hs_args,
                                        *(() if plp is None else (plp,)))
            else:
                # (The mask is passed only when there is one: the programs compiled at start-up, and
                # every unconstrained step, keep the signature without it.)
                args = (self._state_leaves, placed, self.kv_arena, *extra_args, hs_args, sp_args)
                # (the optional trailing arguments up to the last one given)
                tail = (bitmask, pen, plp)
                tail = tail[:max((i + 1 for i, x in enumerate(tail) if x is not None), default=0)]
                res = self.call_variant(key, self._step, *args, *tail) if tail else self._step(*args)
            out, self.kv_arena, hs = res[:3]
            prompt_out = res[3] if plp is not None else None
        if variant is not None and key not in self._first_use_programs:  # compiled just now (once per key)
            self._first_use_programs.add(key)
            self.num_first_use_compiles += 1
            logger.info("the %s step of bucket %d was compiled on first use in %.1f s",
                        variant, key[1], time.perf_counter() - t0)
        self._keep_hisparse(hs)
        if not forward_only:
            self._last_sampled, self._last_out = out[0], out
        return out, hs, prompt_out

    def _step_penalties(self, scheds: list[SchedulerOutput]) -> tuple | None:
        """The step's penalties and logit biases (`serving.penalties.step_penalties`, rows stacked
        replica-major like the request rows; per verification row under MTP speculation), or None
        when no sampled row uses any."""
        return step_penalties(scheds, self.max_num_seqs + 1, self.spec_k + 1 if self.spec_k else 0)

    def _step_bitmask(self, scheds: list[SchedulerOutput]) -> np.ndarray | None:
        """The step's structured-output masks (`SchedulerOutput.grammar_bitmask` of each replica,
        stacked replica-major like the request rows; all ones for a replica without one): int32
        [rows, W], or [rows, k + 1, W] under MTP speculation. None when no replica has one."""
        masks = [s.grammar_bitmask for s in scheds]
        if all(m is None for m in masks):
            return None
        shape = next(m.shape for m in masks if m is not None)
        out = np.concatenate([np.full(shape, -1, np.int32) if m is None else m for m in masks])
        return out if self.spec_k else out[:, 0]

    def _collect_spec(self, sched: SchedulerOutput, toks, acc, drafts, tok_lp, top_ids, top_lp,
                      row0: int = 0) -> dict[str, list[int]]:
        """Speculative step outputs → accepted tokens per sampling request (request i at row
        j = row0 + i: `toks[j, :acc[j] + 1]`); adds to `last_drafts` (the next step's drafts,
        `sched.num_draft_steps` of them), `last_accepted` (drafts accepted per verified request)
        and `last_logprobs` (the caller empties them once per step)."""
        sampled = {}
        n_drafts = max(1, min(self.spec_k, sched.num_draft_steps))
        for i0, sr in enumerate(sched.scheduled):
            if not sr.sample:
                continue
            i = row0 + i0
            a = int(acc[i])
            rid = sr.request_id
            sampled[rid] = [int(t) for t in toks[i, : a + 1]]
            self.last_drafts[rid] = [int(t) for t in drafts[i, :n_drafts]]
            if sr.num_spec_tokens:
                self.last_accepted[rid] = a
            n = sr.request.sampling_params.logprobs
            if n is not None:
                self.last_logprobs[rid] = [
                    TokenLogprobs(int(toks[i, j]), float(tok_lp[i, j]), _allowed(top_ids[i, j, :n], top_lp[i, j, :n]))
                    for j in range(a + 1)]
        return sampled

    def _maybe_fault(self) -> None:
        """The fault-injection test hook (`serving.faults`); a no-op unless armed."""
        if self.faults is None:
            return
        kind = self.faults.fire()
        if kind == "stall":  # an engine thread held up as by a long compile; nothing fails
            time.sleep(STALL_SECONDS)
            return
        if kind == "device_lost":  # what a step that failed after donating its buffers leaves
            for x in self._donated_buffers():
                x.delete()
        if kind is not None:
            raise InjectedFault(f"injected {kind} (fault-injection test hook)")

    def _donated_buffers(self) -> list[jax.Array]:
        """The device state a step donates: the KV arena and HiSparse's hot state and host pool."""
        bufs = [self.kv_arena]
        if self.hisparse is not None:
            bufs += [x for x in jax.tree.leaves(self._hisparse_args()) if isinstance(x, jax.Array)]
        return bufs

    @property
    def step_in_flight(self) -> bool:
        """A multi-host step went to the followers and was not read back yet."""
        return self.steps_in_flight > 0

    def _read_back(self) -> None:
        """A step's outputs are on the host (the multi-host leader: one step fewer in flight)."""
        self.steps_in_flight = max(0, self.steps_in_flight - 1)

    def device_state_lost(self) -> bool:
        """True when a donated buffer was deleted (a step failed after donating it), or when a
        multi-host step failed after its inputs went to the followers: the engine cannot continue
        (`serving.faults.EngineDeadError`)."""
        return self.step_in_flight or any(x.is_deleted() for x in self._donated_buffers())

    def _collect(self, sched: SchedulerOutput, toks, tok_lp, top_ids, top_lp, row0: int = 0) -> dict[str, list[int]]:
        """Sampled tokens of `sched`'s requests from rows `row0 + i` of the step outputs (and
        their `TokenLogprobs` into `last_logprobs`)."""
        sampled = {}
        for i, sr in enumerate(sched.scheduled):
            if not sr.sample:
                continue
            j = row0 + i
            sampled[sr.request_id] = [int(toks[j])]
            n = sr.request.sampling_params.logprobs
            if n is not None:
                self.last_logprobs[sr.request_id] = [TokenLogprobs(
                    int(toks[j]), float(tok_lp[j]), _allowed(top_ids[j, :n], top_lp[j, :n]))]
        return sampled
