"""Compiling structured outputs' step variants in the background (`VariantPrecompileMixin`, mixed
into `serving.runner.ModelRunner`).

The start-up compile (`StepCompileMixin.compile`) builds each token bucket's step program without
a token mask. A step with a constrained request runs a variant of it: the step with the grammar's
bitmask as one more argument ("masked"), or, under asynchronous scheduling, the forward pass alone
("forward-only", whose logits the sampler takes once the masks are known; also every engine's
steps with penalties or logit biases, `serving.penalties`), or the step with prompt-logprob rows
("prompt-logprobs": scoring requests, `serving.prompt_logprobs`; compiled last). Compiled on first use,
a variant stops the engine thread for a whole step compile — every request waits (seconds on the
CPU test model, minutes for the full model). So once the engine has compiled its buckets, the
server compiles the variants in a daemon thread, bucket by bucket from the smallest (decode
steps first), ahead-of-time (`jit(...).lower(abstract arguments).compile()`), and a step whose
variant is ready calls that executable. A step that needs a variant the thread has not reached
takes it out of the queue and compiles it on the engine thread as before; one the thread is
compiling is waited for (less time than starting again).

Same program either way: the executable is compiled from the same jitted function for the same
argument shapes, shardings and donation (`tests/serving/test_structured_variants.py` checks the
streams against the variants compiled on first use), and a variant's first call checks that the
step's arguments are placed as the executable was compiled for (else the jit runs). Left to first use:
HiSparse's hot program (its host pool is in pinned_host memory, which an executable lowered from
abstract arguments mishandles on jax 0.11.2: `variant_jobs`), engines that skip the start-up
compile, and multi-process engines (`StructuredOutputsMixin.start_structured_precompile`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterable

import jax
import numpy as np

from serving.penalties import MIN_WIDTH, empty_penalties
from serving.step_inputs import COPY_DST, COPY_SRC, NUM_SAMPLING, STEPS

logger = logging.getLogger("serving.runner")

def abstract(x):
    """An argument leaf → what `lower` needs of it: a `jax.ShapeDtypeStruct` with the array's
    sharding (memory kind included) for a jax.Array, without one for a host array (the jitted
    program takes it uncommitted, as the step does), anything else unchanged."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x


class _Job:
    """One variant to compile: its key, the jitted function and the abstract arguments."""

    __slots__ = ("args", "compiled", "done", "error", "fn", "key", "placed", "state")

    def __init__(self, key: tuple, fn, args: tuple):
        self.key, self.fn, self.args = key, fn, args
        self.state = "queued"  # → "compiling" → "done", or "taken" (the engine thread compiles it)
        self.compiled = None
        self.placed = False  # the first call's arguments were placed as `args` (`call_variant`)
        self.error: BaseException | None = None
        self.done = threading.Event()


class VariantPrecompileMixin:
    """Background compiles of the step variants (module docstring). The runner provides
    `_step`, `_forward`, `_sample`, `_dummy`, `_place`, `_put`, `_hisparse_args`, `buckets`,
    `kv_arena`, `_state_leaves`, `max_num_seqs`, `dp`, `spec_k`."""

    _variant_jobs: dict | None = None
    _variant_thread: threading.Thread | None = None
    _variant_stop: threading.Event | None = None
    variant_compile_seconds: dict | None = None
    # Guards a job's queued → compiling / taken transition between the thread and the engine
    # thread (one lock for every runner of the process: the transitions are rare and short).
    _variant_lock = threading.Lock()
    num_precompiled_calls = 0  # steps (and deferred samplers) that ran a background-compiled executable

    def variant_jobs(self, bitmask_words: int, forward_only: bool) -> list[_Job]:
        """The variants a constrained step may run, smallest bucket first: per bucket the forward
        pass alone when `forward_only` (asynchronous scheduling) and the masked step, of the plain
        program; then the sampler with and without a mask when `forward_only`; then, per bucket,
        the step with prompt-logprob rows (`serving.prompt_logprobs`). Built on the
        calling thread: only shapes, dtypes and shardings are kept (the thread never touches the
        live arena, which steps donate).

        Not HiSparse's hot program: it takes the host pool in pinned_host memory, and on jax 0.11.2
        a program lowered from abstract arguments in that memory kind returns the donated pool in
        device memory, and its next call aborts the process (a jit call traced from the arrays
        themselves keeps the memory kind). Hot steps compile their variants on first use; any job
        with an argument in a host memory kind is left out the same way (`_device_only`)."""
        def tree(x):
            return jax.tree.map(abstract, x)

        state, arena = tree(self._state_leaves), tree(self.kv_arena)
        rows = (self.max_num_seqs + 1) * self.dp
        mask_shape = (rows, self.spec_k + 1, bitmask_words) if self.spec_k else (rows, bitmask_words)
        bitmask = tree(self._put(np.full(mask_shape, -1, np.int32)))
        jobs, prompt_jobs = [], []
        for T in self.buckets:
            batch, extra = self._dummy(T)
            batch.hot = None  # the plain program (run_inputs' key: plain = True)
            n = batch.input_ids_T.shape[0]  # the step's key: all replicas' tokens under DP
            placed = self._place(batch)
            put_extra = [self._put(x) for x in extra]
            spec = None if self._dummy_spec is None else jax.tree.map(self._put, self._dummy_spec)
            if spec is not None:  # MTP: the step takes these from `_spec_inputs` (its placements)
                placed, put_extra[STEPS], spec = self._spec_inputs(placed, put_extra[STEPS], spec, None)
            placed, put_extra, spec = tree(placed), tree(tuple(put_extra)), tree(spec)
            if forward_only:
                jobs.append(_Job(("forward-only", n, True), self._forward,
                                 (state, placed, arena, put_extra[COPY_SRC], put_extra[COPY_DST], None)))
            jobs.append(_Job(("masked", n, True), self._step, (state, placed, arena, *put_extra, None, spec, bitmask)))
            # The whole step with prompt-logprob rows (serving/prompt_logprobs.py: scoring requests), n of
            # them and their count; after every other job (`run_inputs` passes None for mask and penalties).
            plp = tree(tuple(self._put(x) for x in (np.zeros(n, np.int32), np.zeros(n, np.int32), np.int32(0))))
            prompt_jobs.append(_Job(("prompt-logprobs", n, True), self._step,
                                    (state, placed, arena, *put_extra, None, spec, None, None, plp)))
        jobs = [j for j in jobs if _device_only(j.args)]
        if forward_only and jobs:
            # The logits argument (None here) is the first forward pass's output, known once it compiled.
            _, extra = self._dummy(self.buckets[0])
            samp = tree(tuple(self._put(x) for x in extra[:NUM_SAMPLING]))
            jobs.append(_Job(("sample", True), self._sample, (None, *samp, bitmask)))
            jobs.append(_Job(("sample", False), self._sample, (None, *samp)))
            # The sampler with penalties / logit biases at the smallest entry count (serving/penalties.py).
            pen = tree(tuple(self._put(x) for x in empty_penalties(rows)))
            jobs.append(_Job(("sample", False, f"penalized{MIN_WIDTH}"), self._sample, (None, *samp, None, pen)))
        return jobs + [j for j in prompt_jobs if _device_only(j.args)]

    def start_variant_precompile(self, bitmask_words: int, forward_only: bool) -> int:
        """Compile `variant_jobs(bitmask_words, forward_only)` in a daemon thread (module
        docstring). Returns how many variants it will compile. Call once, on the engine thread,
        after `compile`; `stop_variant_precompile` stops it after the compile in progress."""
        if self._variant_thread is not None:
            raise RuntimeError("the step variants are already being compiled")
        jobs = self.variant_jobs(bitmask_words, forward_only)
        self._variant_jobs = {j.key: j for j in jobs}
        self.variant_compile_seconds = {}
        self._variant_stop = threading.Event()
        self._variant_thread = threading.Thread(target=self._compile_variants, args=(jobs, self._variant_stop),
                                                name="step-variant-compile", daemon=True)
        # At interpreter exit (an offline LLM's script ending), wait for the variant in progress:
        # tearing the interpreter down under a running XLA compile crashes it (the server exits
        # with os._exit instead, serving/run.py). The thread unregisters this when it ends.
        atexit.register(self.stop_variant_precompile, None)
        self._variant_thread.start()
        return len(jobs)

    def stop_variant_precompile(self, timeout: float | None = 0.0) -> None:
        """Ask the background compile to stop after the variant in progress; wait up to `timeout`
        seconds for it (None: until it stops)."""
        if self._variant_thread is None:
            return
        self._variant_stop.set()
        self._variant_thread.join(timeout)

    def variant_precompile_running(self) -> bool:
        """Whether the background compile thread is alive (after `stop_variant_precompile`: still
        finishing the variant in progress, inside XLA, which cannot be interrupted)."""
        return self._variant_thread is not None and self._variant_thread.is_alive()

    def wait_variant_precompile(self, timeout: float | None = None) -> bool:
        """Wait for the background compile to finish → whether it has (True without one)."""
        if self._variant_thread is None:
            return True
        self._variant_thread.join(timeout)
        return not self._variant_thread.is_alive()

    def _compile_variants(self, jobs: Iterable[_Job], stop: threading.Event) -> None:
        t0 = time.perf_counter()
        n = 0
        kernel_mode = self.kernel_mode
        from kernels.mode import use_kernels

        logits = None
        for job in jobs:
            if stop.is_set():
                break
            if job.key[0] == "sample":
                if logits is None:
                    continue  # no forward pass compiled: the sampler compiles on first use
                job.args = (logits, *job.args[1:])
            with self._variant_lock:
                if job.state != "queued":
                    continue
                job.state = "compiling"
            t = time.perf_counter()
            try:
                with use_kernels(kernel_mode):
                    job.compiled = job.fn.lower(*job.args).compile()
                n += 1
                if job.key[0] == "forward-only" and logits is None:
                    o = job.compiled.out_info[0]
                    logits = jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding)
            except Exception as e:  # noqa: BLE001 - the engine thread compiles it on first use instead
                job.error = e
                logger.warning("compiling the %s step variant %s in the background failed "
                               "(%s: %s); it compiles on first use", job.key[0], job.key[1:], type(e).__name__, e)
            self.variant_compile_seconds[job.key] = time.perf_counter() - t
            job.state = "done"
            job.done.set()
        taken = sum(j.state == "taken" for j in self._variant_jobs.values()) if self._variant_jobs else 0
        if n or taken:
            logger.info("%d step variants compiled in the background in %.1f s%s%s", n,
                        time.perf_counter() - t0,
                        f"; {taken} compiled on first use by steps that needed them sooner" if taken else "",
                        " (stopped)" if stop.is_set() else "")
        atexit.unregister(self.stop_variant_precompile)  # nothing left to wait for at exit

    def precompiled_variant(self, key: tuple) -> Callable | None:
        """The background-compiled executable for `key` (waiting for it when the thread is
        compiling it), or None: not a precompiled variant, not reached yet (it is then taken out
        of the queue: the caller's jit compiles it), or failed."""
        jobs = self._variant_jobs
        job = jobs.get(key) if jobs else None
        if job is None:
            return None
        with self._variant_lock:
            if job.state == "queued":
                job.state = "taken"
                return None
        if job.state == "taken":
            return None
        if not job.done.is_set():
            t = time.perf_counter()
            job.done.wait()
            logger.info("waited %.1f s for the background compile of the %s step variant %s",
                        time.perf_counter() - t, key[0], key[1:])
        return job.compiled

    def call_variant(self, key: tuple, fn, *args):
        """`fn(*args)` through the precompiled executable of `key` when there is one and this
        step's arguments are placed as it was compiled for (every array's sharding, memory kind
        included: an executable given a buffer in another memory kind aborts the process instead
        of raising). Otherwise — or when the executable refuses the call before running (its
        argument types differ: a TypeError, nothing donated) — logged once, the variant is dropped
        and `fn` (the jit) runs. The placements are checked at the key's first call only: later
        calls of a key pass the same ones (the plain program's arguments are the weights, the
        arena and host inputs, placed by the same functions every step), and the check walks every
        weight, which a hot path need not repeat."""
        compiled = self.precompiled_variant(key)
        job = self._variant_jobs[key] if compiled is not None else None
        if job is not None and not job.placed:
            if not _placed_as(job.args, args):
                logger.warning("the precompiled %s step variant %s was compiled for other "
                               "argument placements than this step's; it compiles on first use", key[0], key[1:])
                job.compiled = compiled = None
            job.placed = True
        if compiled is not None:
            try:
                out = compiled(*args)
                self._first_use_programs.add(key)  # not compiled on the engine thread
                self.num_precompiled_calls += 1
                return out
            except TypeError as e:
                logger.warning("the precompiled %s step variant %s does not take this step's "
                               "arguments (%s); it compiles on first use", key[0], key[1:], str(e).splitlines()[0])
                self._variant_jobs[key].compiled = None
        return fn(*args)


def _placed_as(specs: tuple, args: tuple) -> bool:
    """Whether `args` has the tree structure of `specs` (the abstract arguments a variant was
    compiled for) and each array leaf its sharding (a host array where the spec has none)."""
    spec_leaves, spec_tree = jax.tree.flatten(specs)
    leaves, tree = jax.tree.flatten(args)
    if tree != spec_tree:
        return False
    for spec, x in zip(spec_leaves, leaves):
        want = getattr(spec, "sharding", None)
        if isinstance(x, jax.Array):
            if want is None or x.sharding != want:
                return False
        elif want is not None:
            return False
    return True


def _device_only(specs) -> bool:
    """Whether no abstract argument is placed in a host memory kind (see `variant_jobs`)."""
    return all(getattr(getattr(x, "sharding", None), "memory_kind", None) in (None, "device")
               for x in jax.tree.leaves(specs))
