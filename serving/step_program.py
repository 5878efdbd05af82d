"""The engine's jitted programs over the model: the step (`forward + sample`, or the speculative
step under MTP) and Hybrid HiSparse's write-through store program.

The step's arguments (all padded to the step's token bucket and to `max_num_seqs + 1` request rows
by `serving.runner.ModelRunner.prepare`): the model state, a `glm53.batch.ForwardBatch`, the KV arena
(donated: updated in place), the sampling parameters per request row (temperature, top-p, seed,
step counter, whether logprobs are wanted), the copy-on-write page lists (int32 source and
destination rows, −1 padded; run before anything writes the arena), HiSparse's `(hot state, host
pool)` (donated) or None, the `SpecBatch` under MTP speculation or None, and structured outputs'
token bitmask or None (`serving.structured_outputs`; jit keeps the two variants apart, so steps
without constrained rows run the program without the mask), and the rows' penalties and logit
biases or None (`serving.penalties`, the same way). It returns the sampler's outputs, the arena
and HiSparse's state.

The step without speculation also comes split in two (`forward`, `sample`) for asynchronous
scheduling with structured outputs or output-dependent penalties: the forward pass is dispatched while the previous step is in
flight and keeps its logits on the device; the masks, which need the previous step's tokens, are
(and the penalties' output counts) computed on the host meanwhile and the sampler runs on the logits afterwards. Forward then sample
gives the outputs of the one-program step. Prompt logprobs (`serving.prompt_logprobs`) come from the
split forward pass too: given prompt-logprob rows it also returns their logprobs, computed from the
step's hidden states.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from glm53.attention import store_host_pages
from glm53.batch import ForwardBatch
from glm53.hot_cache import HostAccess, PagedKV
from glm53.kv_layout import KVCacheLayout
from glm53.sampling import prompt_token_logprobs
from kernels.paged import copy_pages
from serving.hisparse.device_state import HiSparseDeviceState
from serving.sampling import apply_token_bitmask, mask_unreachable, sample_with_logprobs
from serving.spec_decode.step import spec_decode_forward
from sharding.mesh import ParallelLayout

# Prompt logprobs are computed over at most this many token rows at a time (the logits of a block,
# [block, vocab] fp32, are what is live: 158 MB at GLM-5.3's vocabulary).
PROMPT_LOGPROBS_BLOCK = 256


def build_step_programs(graphdef, layout: KVCacheLayout, parallel: ParallelLayout | None,
                        hisparse: HiSparseDeviceState | None, spec_k: int, reachable: int, k: int, state_def=None):
    """→ (step, store_only, forward, sample): the jitted step, HiSparse's jitted store program
    (None without HiSparse), and the step split in two (None under speculation): `forward(state,
    batch, kv_arena, copy_src, copy_dst, hs, plp=None)` → (the logits of the request rows [B, V], the unreachable ids
    masked, the arena, HiSparse's state, and with `plp = (rows_P, targets_P, count)` the prompt logprobs of
    those token rows: target logprob [P], rank [P], top ids [P, k], top logprobs [P, k]), and `sample(logits, temperature, top_p, top_k, min_p, seeds,
    steps, want_logprobs, bitmask=None, pen=None)` → the sampler's outputs (pen: the arguments of
    `glm53.sampling.apply_penalties` after the logits, or None).

    Args:
      graphdef: the model's `nnx` graph definition (the state is the step's first argument).
      state_def: the treedef of the model state when the step gets the state's leaves (a list:
        flattened once at start-up, so a dispatch does not flatten the `nnx.State` again, which
        costs ≈ 0.5 ms per call on the CPU); None: the step gets the `nnx.State`.
      layout: the KV arena layout. parallel: the parallel layout or None (one device).
      hisparse: the HiSparse device state (its host-access mechanism and narrow rows) or None.
      spec_k: MTP draft tokens per step (0: no speculation). reachable: ids at or past it are never
        sampled (`mask_unreachable`). k: logprobs computed per sampled row.
    """
    mechanism = hisparse.mechanism if hisparse is not None else None
    # Multi-process (serving/multihost): the sampler's outputs are made replicated over the mesh,
    # so that the leader reads them from its own devices (a DP-sharded output would put other
    # replicas' rows on other processes' devices).
    replicate = None
    if parallel is not None and jax.process_count() > 1:
        replicate = jax.sharding.NamedSharding(parallel.mesh, jax.sharding.PartitionSpec())
    narrow_rows = hisparse.narrow_rows if hisparse is not None else None

    @functools.partial(jax.jit, donate_argnums=(2, 12))
    def step(state, batch: ForwardBatch, kv_arena, temperature, top_p, top_k, min_p, seeds, steps, want_logprobs,
             copy_src, copy_dst, hs, sp=None, bitmask=None, pen=None, plp=None):
        # temperature … want_logprobs: the sampler's inputs (`serving.step_inputs.StepInputs`).
        # hs: None, or HiSparse's (hot state, host pool, after), donated. (Its write-through
        # copies run before, in their own program: `run_stores`; `after` is that program's
        # completion value, an operand of the step's host reads, returned unchanged.)
        # sp: the `SpecBatch` under MTP speculation.
        # bitmask: structured outputs' packed allowed-token masks (int32 [B, W], or [B, k + 1, W]
        # under speculation) or None: a step without constrained rows is the program without it.
        # pen: the penalties and logit biases of the step's rows (`serving.penalties`) or None, as
        # the bitmask (under speculation per verification row).
        # plp: the prompt-logprob rows (rows_P, targets_P, count) or None, as the bitmask; with them the
        # step returns their logprobs (`prompt_logprobs`) after HiSparse's state.
        host = None
        if hs is not None:
            hot, pool, after = hs
            host = HostAccess(pool, mechanism, after=after, narrow_rows=narrow_rows)
        kv_arena = copy_pages(kv_arena, copy_src, copy_dst)  # copy-on-write pages, before any write
        model = nnx.merge(graphdef, state if state_def is None else jax.tree.unflatten(state_def, state))
        if sp is not None:
            kv = kv_arena if hs is None else PagedKV(kv_arena, hot.for_step())
            out, kv, h = spec_decode_forward(model, batch, kv, host, (temperature, top_p, top_k, min_p, seeds, steps),
                                             want_logprobs, sp, layout=layout, parallel=parallel,
                                             num_speculative_tokens=spec_k, reachable=reachable, num_logprobs=k,
                                             bitmask_BSW=bitmask, pen=pen)
            if replicate is not None:
                out = jax.lax.with_sharding_constraint(out, replicate)
            hs_out = None if hs is None else (kv.hot, host.pool, host.after)
            kv_arena = kv if hs is None else kv.arena
        else:
            logits, h, kv_arena, hs_out = model_logits(model, batch, kv_arena, hs, host)
            out = _sample(logits, temperature, top_p, top_k, min_p, seeds, steps, want_logprobs, bitmask, pen)
        if plp is None:
            return out, kv_arena, hs_out
        return out, kv_arena, hs_out, prompt_logprobs(model, h, plp)

    def model_logits(model, batch, kv_arena, hs, host):
        """The forward pass without speculation → (logits with the unreachable ids masked, the
        final hidden states [T, D], the arena, HiSparse's state or None)."""
        if hs is None:
            logits, h, kv_arena = model(batch, kv_arena, layout, parallel)
            return mask_unreachable(logits, reachable), h, kv_arena, None
        kv = PagedKV(kv_arena, hs[0].for_step())
        logits, h, kv = model(batch, kv, layout, parallel, host)
        return mask_unreachable(logits, reachable), h, kv.arena, (kv.hot, host.pool, host.after)

    def prompt_logprobs(model, h_TD, plp):
        """`glm53.sampling.prompt_token_logprobs` of the token rows `plp = (rows_P, targets_P,
        count)` of the step's hidden states (rows in the placed token order; P is the step's token
        count, the first `count` rows real, the rest padding), in blocks of at most
        `PROMPT_LOGPROBS_BLOCK` rows so that the logits of a block ([block, vocab] fp32) and not of
        the whole step are live at once; blocks past `count` are skipped (zeros), so a step
        computes the rows it has, not its bucket's."""
        rows_P, target_P, count = plp
        P = rows_P.shape[0]
        blk = min(P, PROMPT_LOGPROBS_BLOCK)
        n = -(-P // blk)
        pad = lambda x: jnp.pad(x, (0, n * blk - P)).reshape(n, blk)

        def block(args):
            i, rows, target = args

            def compute():
                return prompt_token_logprobs(mask_unreachable(model.logits(h_TD[rows]), reachable), target, k)

            def skip():
                return (jnp.zeros((blk,), jnp.float32), jnp.zeros((blk,), jnp.int32), jnp.zeros((blk, k), jnp.int32),
                        jnp.zeros((blk, k), jnp.float32))

            return jax.lax.cond(i * blk < count, compute, skip)

        out = jax.lax.map(block, (jnp.arange(n, dtype=jnp.int32), pad(rows_P), pad(target_P)))
        out = tuple(x.reshape(n * blk, *x.shape[2:])[:P] for x in out)
        if replicate is not None:
            out = jax.lax.with_sharding_constraint(out, replicate)
        return out

    def _sample(logits, temperature, top_p, top_k, min_p, seeds, steps, want_logprobs, bitmask=None, pen=None):
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        out = sample_with_logprobs(logits, temperature, top_p, top_k, min_p, seeds, steps, want_logprobs, k, pen)
        if replicate is not None:
            out = jax.lax.with_sharding_constraint(out, replicate)
        return out

    forward = sample = None
    if not spec_k:
        @functools.partial(jax.jit, donate_argnums=(2, 5))
        def forward(state, batch: ForwardBatch, kv_arena, copy_src, copy_dst, hs, plp=None):
            # plp: None, or the prompt-logprob rows (rows_P, targets_P, count) of `prompt_logprobs`,
            # whose outputs then follow HiSparse's state (a variant of its own, as the mask).
            host = None if hs is None else HostAccess(hs[1], mechanism, after=hs[2], narrow_rows=narrow_rows)
            kv_arena = copy_pages(kv_arena, copy_src, copy_dst)
            model = nnx.merge(graphdef, state if state_def is None else jax.tree.unflatten(state_def, state))
            logits, h, kv_arena, hs_out = model_logits(model, batch, kv_arena, hs, host)
            if plp is None:
                return logits, kv_arena, hs_out
            return logits, kv_arena, hs_out, prompt_logprobs(model, h, plp)

        sample = jax.jit(_sample)

    store_only = None
    if hisparse is not None:
        # The write-through copies are a program of their own, dispatched before the step that
        # follows the one that sealed the pages: it reads the arena (ordered after the
        # previous step's writes and, the step donating the arena, before this step's) and
        # updates the host pool. Inside the step, a loop reading the arena that the step
        # then updates in place would make XLA copy the whole arena every step.
        @functools.partial(jax.jit, donate_argnums=(0,))
        def store_only(pool, kv_arena, store_src, store_dst):
            return store_host_pages(pool, kv_arena, store_src, store_dst, layout, "mla", mechanism=mechanism,
                                    parallel=parallel)

    return step, store_only, forward, sample
