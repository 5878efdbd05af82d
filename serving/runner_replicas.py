"""The model runner's data-parallel steps (`--data-parallel-size`, serving/dp_engine.py): one
jitted step for every attention replica, their batches stacked replica-major
(`glm53.parallel_batch.stack_replicas`). A mixin of `serving.runner.ModelRunner`, whose
`prepare`, `_feed`, `_launch`, `_fetch_outputs` and `_collect` it uses."""

from __future__ import annotations

import time

import numpy as np

from glm53.parallel_batch import stack_replicas
from serving.kv_cache import KVCacheManager
from serving.scheduler_output import SchedulerOutput
from serving.spec_decode.inputs import build_spec_batch, stack_spec_batches
from serving.step_inputs import (
    COPY_DST,
    COPY_SRC,
    NUM_SAMPLING,
    WANT_LOGPROBS,
    StepInputs,
)
from serving.step_stats import InFlightStep


class ReplicaStepsMixin:
    """`execute_replicas` = `dispatch_replicas` + `finish_replicas` (see each)."""

    def execute_replicas(self, scheds: list[SchedulerOutput], kvs: list[KVCacheManager]) -> list[dict[str, list[int]]]:
        """Data parallel: one step for all `dp` replicas (`scheds[r]` over `kvs[r]`, replica r);
        `dispatch_replicas` then `finish_replicas`. Returns the sampled tokens per replica;
        `last_logprobs` holds those of every replica (request ids are unique across replicas)."""
        return self.finish_replicas(self.dispatch_replicas(scheds, kvs))

    def dispatch_replicas(self, scheds: list[SchedulerOutput], kvs: list[KVCacheManager],
                          prev: InFlightStep | None = None, defer_sampling: bool = False) -> InFlightStep:
        """Data parallel: prepare and dispatch one step for all `dp` replicas without waiting
        (`finish_replicas` reads it back).

        Every replica is padded to the bucket of the largest replica's token count and to
        `max_num_seqs + 1` rows; a replica with nothing scheduled runs padding rows only (slot −1,
        the null row: nothing is written). The batches are stacked replica-major
        (`glm53.parallel_batch.stack_replicas`), so replica r's tokens, rows and sampled tokens are
        the r-th slices and its slots/block ids address its own arena shards. Page copies of all
        replicas run first, each in its replica's shards.
        prev: the step in flight (asynchronous scheduling): placeholder rows take their input
        token from it on the device, as in `dispatch`. defer_sampling: the forward pass only, as
        in `dispatch`.

        Raises ValueError when `len(scheds) != dp`, a replica's step exceeds the largest bucket,
        or a placeholder's request is not a sampling request of `prev`.
        """
        if len(scheds) != self.dp or len(kvs) != self.dp:
            raise ValueError(f"{len(scheds)} replica schedules for {self.dp} replicas")
        t0 = time.perf_counter()
        T = self.bucket(max(s.num_scheduled_tokens for s in scheds))
        parts = [self.prepare(s, kv, T, r) for r, (s, kv) in enumerate(zip(scheds, kvs))]
        feed_src = self._feed(prev, scheds, T)
        self._dispatch_stores()
        if self.offload is not None:
            self.run_offload([s.page_loads for s in scheds])
        batch = stack_replicas([b for b, _ in parts], self.parallel.pcp)
        cat = lambda k: np.concatenate([e[k] for _, e in parts])
        want_lp = np.bool_(any(bool(e[WANT_LOGPROBS]) for _, e in parts))
        copies = np.full((2, self.max_page_copies), -1, np.int32)
        valid = np.concatenate([np.stack((e[COPY_SRC], e[COPY_DST]))[:, np.asarray(e[COPY_DST]) >= 0]
                                for _, e in parts], axis=1)
        copies[:, : valid.shape[1]] = valid  # valid entries first (copy_pages stops at the first −1)
        extra = (*(cat(i) for i in range(NUM_SAMPLING - 1)), want_lp, *copies)
        sp = spec_feed = None
        if self.spec_k:  # each replica's verification rows and drafts, its rows offset by r · T
            B = self.max_num_seqs + 1
            sp = stack_spec_batches([build_spec_batch(s, T, B, self.spec_k, s.num_draft_steps) for s in scheds], T)
            feed_src, spec_feed = None, feed_src
        self._maybe_fault()
        return self._launch(scheds, StepInputs(batch, extra, sp, self._step_bitmask(scheds), feed_src,
                                               None if defer_sampling else self._step_penalties(scheds),
                                               spec_feed=spec_feed), t0,
                            defer_sampling, self._prompt_rows(scheds, T))

    def finish_replicas(self, step: InFlightStep, overlapped: bool = False) -> list[dict[str, list[int]]]:
        """Wait for a `dispatch_replicas` step and read it back → the sampled tokens per replica
        (as `finish`: `last`, `last_logprobs`, and `last_truncated` as one dict per replica)."""
        out, self.last_truncated = self._fetch_outputs(step, overlapped)
        B = self.max_num_seqs + 1
        if self.spec_k:  # MTP speculation: `last_drafts` / `last_accepted` of every replica
            toks, acc, drafts, tok_lp, top_ids, top_lp = out
            self.last_drafts, self.last_accepted = {}, {}
            return [self._collect_spec(s, toks, acc, drafts, tok_lp, top_ids, top_lp, r * B)
                    for r, s in enumerate(step.scheds)]
        toks, tok_lp, top_ids, top_lp = out
        return [self._collect(s, toks, tok_lp, top_ids, top_lp, r * B) for r, s in enumerate(step.scheds)]
