"""The model runner's step programs before they serve: padding arguments, the start-up compile of
every token bucket (with a progress bar), tracing for introspection and export, and asynchronous
scheduling's token feed (`StepCompileMixin`, mixed into `serving.runner.ModelRunner`, which
provides the programs, buckets, arena and HiSparse state it uses).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from glm53.batch import ForwardBatch
from glm53.parallel_batch import stack_replicas
from kernels.mode import use_kernels
from serving.spec_decode.feed import spec_feed_program
from serving.spec_decode.inputs import empty_spec_batch
from serving.step_inputs import STEPS

logger = logging.getLogger("serving.runner")


def _feed_tokens_fn(ids_T, src_T, prev_B):
    """Asynchronous scheduling: the step's input ids with every placeholder row (src_T ≥ 0)
    replaced on the device by the token the previous step sampled in row src_T.
    ids_T / src_T int32 [T]; prev_B int32 [B] (the previous step's `out[0]`)."""
    return jnp.where(src_T >= 0, prev_B[jnp.maximum(src_T, 0)].astype(ids_T.dtype), ids_T)


class StepCompileMixin:
    """Compiling and tracing the runner's step programs (module docstring)."""

    def _dummy(self, T: int):
        B = self.max_num_seqs + 1
        batch = ForwardBatch(
            input_ids_T=np.zeros(T, np.int32), positions_T=np.zeros(T, np.int32),
            req_idx_T=np.full(T, B - 1, np.int32),
            slot_mapping={g: np.full(T, -1, np.int32) for g in self.widths},
            block_tables={g: np.zeros((B, w), np.int32) for g, w in self.widths.items()},
            logits_indices_B=np.zeros(B, np.int32))
        if self.hisparse is not None:
            batch.hot = self.hisparse.empty_inputs(B, self.widths["mla"])
        if self.dp > 1:  # one padding batch per replica, stacked (the step's global shapes)
            batch, B = stack_replicas([batch] * self.dp, self.parallel.pcp), B * self.dp
        z = np.zeros(B, np.float32)
        copies = np.full((2, self.max_page_copies), -1, np.int32)
        self._dummy_spec = empty_spec_batch(len(batch.input_ids_T), B, self.spec_k) if self.spec_k else None
        return batch, (z, np.ones(B, np.float32), np.zeros(B, np.int32), z, np.zeros(B, np.uint32),
                       np.zeros(B, np.int32), np.bool_(False), *copies)

    def example_step_args(self, hot: bool = False) -> tuple:
        """Arguments of the jitted step for the first bucket, as the start-up compile builds them:
        padding rows that write nothing; with `hot`, HiSparse's hot program (ValueError without
        HiSparse), else the plain one. For tracing and export (`trace_step`, the CUDA export test)."""
        if hot and self.hisparse is None:
            raise ValueError("hot=True needs an engine with Hybrid HiSparse")
        batch, extra = self._dummy(self.buckets[0])
        if not hot:
            batch.hot = None
        return (self._state_leaves, self._place(batch), self.kv_arena, *extra,
                self._hisparse_args() if hot else None, self._dummy_spec)

    def trace_step(self, hot: bool = False):
        """The step program's jaxpr (`jax.make_jaxpr`) for the first bucket, under the kernel mode
        the runner was built with: what the compiled step calls (`kernels.introspect`)."""
        with use_kernels(self.kernel_mode):
            return jax.make_jaxpr(self._step)(*self.example_step_args(hot))

    def compile(self, progress: bool = True) -> float:
        """Compile every bucket (runs each once on padding rows, which write nothing). → seconds.

        Each bucket's compile time (seconds, a persistent-cache hit included) is kept in
        `compile_seconds` and logged."""
        t0 = time.perf_counter()
        self.compile_seconds: dict[int, float] = {}
        for T in tqdm(self.buckets, desc="compiling step buckets", disable=not progress, unit="bucket"):
            t = time.perf_counter()
            batch, extra = self._dummy(T)
            # HiSparse compiles both programs of a bucket: with the hot path, and plain (`execute`).
            for hs_args in ([self._hisparse_args()] if self.hisparse is not None else []) + [None]:
                if hs_args is None:
                    batch.hot = None
                spec = None if self._dummy_spec is None else jax.tree.map(self._put, self._dummy_spec)
                placed = self._place(batch)
                extra_args = [self._put(x) for x in extra]
                if spec is not None:
                    placed, extra_args[STEPS], spec = self._spec_inputs(placed, extra_args[STEPS], spec, None)
                with use_kernels(self.kernel_mode):
                    out, self.kv_arena, hs = self._step(self._state_leaves, placed, self.kv_arena,
                                                        *extra_args, hs_args, spec)
                self._keep_hisparse(hs)
                jax.block_until_ready(out)
            if self.spec_k:  # asynchronous scheduling's feed for this bucket (MTP's)
                tokens, rows = placed.input_ids_T.shape[0], extra_args[STEPS].shape[0]
                no_feed = (np.full(tokens, -1, np.int32),) * 4 + (np.full(rows, -1, np.int32),) * 2
                self._last_out = out
                jax.block_until_ready(self._spec_inputs(self._place(batch), self._put(extra[STEPS]),
                                                        jax.tree.map(self._put, self._dummy_spec), no_feed))
            else:  # asynchronous scheduling's token feed for this bucket
                no_feed = np.full(placed.input_ids_T.shape[0], -1, np.int32)
                jax.block_until_ready(self._feed_tokens(placed.input_ids_T, self._put(no_feed), out[0]))
            self.compile_seconds[T] = time.perf_counter() - t
        if self.hisparse is not None:
            self.run_stores([], wait=True)  # the store program
        logger.info("step bucket compile seconds: %s",
                    ", ".join(f"{T}: {s:.1f}" for T, s in self.compile_seconds.items()))
        return time.perf_counter() - t0

    def _feed_tokens(self, ids_T, src_T, prev_B):
        """`_feed_tokens_fn` jitted with the placed input ids' own sharding as its output's, so the
        step sees the same argument signature with and without the feed (one compiled program per
        bucket; a fed step must not recompile the step)."""
        sharding = ids_T.sharding
        fn = self._feeds.get(sharding)
        if fn is None:
            fn = self._feeds[sharding] = jax.jit(_feed_tokens_fn, out_shardings=sharding)
        return fn(ids_T, src_T, prev_B)

    def _spec_inputs(self, placed: ForwardBatch, steps_B, sp, feed: tuple | None):
        """MTP speculation: the step's input ids, positions, slots, step counters and `SpecBatch`
        through a program of their own, so that the step takes them in one form (device arrays on
        fixed shardings) whether or not a step in flight feeds them: with `feed`
        (`StepInputs.spec_feed`, asynchronous scheduling) `serving.spec_decode.feed.apply_spec_feed`
        with the outputs of the step dispatched last (`_last_out`), else the same arrays unchanged
        (an upload: 52 µs on the CPU against 333 µs for `jax.device_put` of the same arrays,
        `scripts/probe_spec_inputs_upload.py`).
        → (batch, steps_B, sp). Raises RuntimeError when fed with no step dispatched before."""
        fed = feed is not None
        fn = self._feeds.get(("spec", fed))
        if fn is None:
            dcp = self.parallel.dcp if self.parallel is not None else 1
            tpp = {g.name: g.tokens_per_page * dcp for g in self.layout.groups}
            if self.parallel is None:
                default = self._ids_sharding
            else:
                default = jax.sharding.NamedSharding(self.parallel.mesh, jax.sharding.PartitionSpec())
            shard = lambda x: x.sharding if isinstance(x, jax.Array) else default
            shardings = jax.tree.map(shard, (placed.input_ids_T, placed.positions_T, placed.slot_mapping, steps_B, sp))
            fn = self._feeds["spec", fed] = spec_feed_program(tpp, self.dp, shardings, fed)
        args = (placed.input_ids_T, placed.positions_T, placed.req_idx_T, placed.slot_mapping, placed.block_tables,
                steps_B, sp)
        if fed:
            if self._last_out is None:
                raise RuntimeError("a fed step needs a previous step's outputs")
            args += (tuple(map(self._put, feed)), self._last_out[:3])
        ids, pos, slots, steps_B, sp = fn(*args)
        return dataclasses.replace(placed, input_ids_T=ids, positions_T=pos, slot_mapping=slots), steps_B, sp
