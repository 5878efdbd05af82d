"""The speculative part of the jitted step: target rows → verification → MTP drafts.

Called by `serving.runner.ModelRunner`'s step under MTP speculation instead of the plain
`forward + sample`; everything runs on the device, the host reads the outputs after the step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from glm53.mtp import propose_drafts
from glm53.sampling import apply_penalties
from serving.sampling import apply_token_bitmask, compute_logprobs, mask_unreachable
from serving.spec_decode.inputs import SpecBatch
from serving.spec_decode.rejection import verify_drafts
from sharding.context_parallel import pcp_chunk_order, pcp_placed_rows


def spec_decode_forward(model, batch, kv, host, sampling: tuple, want_logprobs, sp: SpecBatch, *, layout, parallel, num_speculative_tokens: int, reachable: int,
                        num_logprobs: int, bitmask_BSW=None, pen=None):
    """One speculative step over `batch` (T rows, B request rows).

    1. The target model over every row (`hidden_states`: prefill chunks, decode rows and the
       verification rows `[t, d_1 … d_n]` alike), logits at rows `sp.sample_row_B + j`, j = 0…k.
    2. `verify_drafts`: accepted drafts and the correction / bonus token per request, with the
       sampling parameters of `serving.sampling` (and, when `want_logprobs`, the logprobs of every
       row's token).
    3. `propose_drafts`: the MTP layer's k drafts per sampling request for the next step, its first
       step fed the token just emitted at each request's last accepted row.

    Args:
      kv: the arena, or a `PagedKV` (HiSparse), returned updated in the same form.
      sampling: `(temperature_B, top_p_B, top_k_B, min_p_B, seed_B, step_B)`, the sampler's `[B]`
        arrays (`serving.sampling.sample_tokens`).
      host: HiSparse host access or None.
      num_logprobs: static width of the top-logprobs arrays.
      bitmask_BSW: structured outputs' packed allowed-token masks, int32 `[B, k + 1, W]` (row j:
        the grammar's state after the drafts before it; a draft the grammar forbids is then
        rejected, its target probability being 0), or None.
      pen: the rows' penalties and logit biases (`serving.penalties.step_penalties` with k + 1
        positions: entries of the verification rows b · (k + 1) + j, row j counting the drafts
        before it; factors `[B · (k + 1)]`), or None. Verification and the tokens use the adjusted
        logits, the logprobs the raw ones.

    Returns `((tokens_BS, num_accepted_B, drafts_BK, token_logprob_BS, top_ids_BSL, top_logprobs_BSL), kv,
    hidden_TD)` with S = k + 1; the logprob arrays are zeros unless `want_logprobs`; `hidden_TD`: the
    target model's final hidden states (prompt logprobs, `serving.prompt_logprobs`; XLA drops them
    from a step that does not use them).
    """
    k = num_speculative_tokens
    h, kv = model.hidden_states(batch, kv, layout, parallel, host)
    T, B_all, S = h.shape[0], sp.sample_row_B.shape[0], k + 1
    # Every scheduled request has at least one row, so a replica's first min(B, T) request rows
    # hold them all: verification and drafting run on those only (a batch-1 decode step of bucket
    # k + 1 does not verify and draft for max_num_seqs + 1 rows), and the outputs are put back in
    # their B rows. Under data parallelism (dp replicas stacked replica-major, B and T rows each)
    # the kept rows are every replica's first min(B, T).
    dp = parallel.dp if parallel is not None else 1
    B_r, T_r = B_all // dp, T // dp
    Bk = min(B_r, T_r)
    B = dp * Bk

    def take(x):
        return _first_rows_per_replica(x, dp, Bk)
    sp = dataclasses.replace(sp, sample_row_B=take(sp.sample_row_B), draft_BK=take(sp.draft_BK),
                             num_draft_B=take(sp.num_draft_B), valid_B=take(sp.valid_B))
    sampling = tuple(take(x) for x in sampling)
    # Rows are numbered in token order (the host's); under PCP the step's rows are in each
    # replica's load-balanced order (glm53.parallel_batch.pcp_reorder), a permutation fixed by the
    # bucket: `placed` maps a token row to its row there, `order` the other way.
    pcp = parallel.pcp if parallel is not None else 1
    mtp_ids_T = sp.mtp_ids_T
    if pcp > 1:
        base = np.arange(dp)[:, None] * T_r
        placed_T = jnp.asarray((base + pcp_placed_rows(T_r, pcp)[None, :]).reshape(-1).astype(np.int32))
        mtp_ids_T = mtp_ids_T[(base + pcp_chunk_order(T_r, pcp)[None, :]).reshape(-1)]
        to_placed = lambda rows: placed_T[rows]
    else:
        to_placed = lambda rows: rows
    rows_BS = jnp.clip(sp.sample_row_B[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :], 0, T - 1)
    logits = mask_unreachable(model.logits(h[to_placed(rows_BS).reshape(-1)]), reachable)
    if bitmask_BSW is not None:
        logits = apply_token_bitmask(logits, take(bitmask_BSW).reshape(B * S, -1))
    target = logits
    if pen is not None:  # entries of the rows cut above are dropped
        # entry row b · S + j of the B_all request rows → its kept row (−1: cut)
        row_E = pen[0]
        b_E, j_E = row_E // S, row_E % S
        local_E = b_E % B_r
        row_E = jnp.where((row_E >= 0) & (local_E < Bk), ((b_E // B_r) * Bk + local_E) * S + j_E, -1)
        factors = (take(x.reshape(B_all, S)).reshape(-1) for x in pen[5:])
        target = apply_penalties(logits.astype(jnp.float32), row_E, *pen[1:5], *factors)
    tokens_BS, acc_B = verify_drafts(target.reshape(B, S, -1), sp.draft_BK, sp.num_draft_B, *sampling)
    L = num_logprobs

    def lps():
        t, i, v = compute_logprobs(logits, tokens_BS.reshape(-1), L)
        return t.reshape(B, S), i.reshape(B, S, L), v.reshape(B, S, L)

    def no_lps():
        return jnp.zeros((B, S), jnp.float32), jnp.zeros((B, S, L), jnp.int32), jnp.zeros((B, S, L), jnp.float32)

    lp = jax.lax.cond(want_logprobs, lps, no_lps)
    last_row_B = jnp.where(sp.valid_B, to_placed(sp.sample_row_B + acc_B), 0)
    emitted_B = jnp.take_along_axis(tokens_BS, acc_B[:, None], axis=1)[:, 0]  # the token after the last accepted row
    mtp_ids = mtp_ids_T.at[jnp.where(sp.valid_B, last_row_B, T)].set(emitted_B, mode="drop")
    # The draft steps after the first run one row per request, split over the PCP ranks too: each
    # replica's rows are padded to a multiple of pcp with rows that draft nothing.
    Bp = -(-Bk // pcp) * pcp
    drafts_BK, kv = propose_drafts(model, batch, mtp_ids, h, kv, layout,
                                   last_row_B=_pad_rows_per_replica(last_row_B, dp, Bp, 0),
                                   valid_B=_pad_rows_per_replica(sp.valid_B, dp, Bp, False),
                                   num_steps=sp.num_draft_steps, k=k, reachable=reachable, parallel=parallel,
                                   host=host)
    drafts_BK = _first_rows_per_replica(drafts_BK, dp, Bk)
    return tuple(_pad_rows_per_replica(x, dp, B_r, 0) for x in (tokens_BS, acc_B, drafts_BK, *lp)), kv, h


def _first_rows_per_replica(x: jax.Array, dp: int, n: int) -> jax.Array:
    """`x [dp · m, ...]` (dp replicas' rows, replica-major) → each replica's first n rows `[dp · n, ...]`."""
    return x.reshape((dp, -1) + x.shape[1:])[:, :n].reshape((-1,) + x.shape[1:])


def _pad_rows_per_replica(x: jax.Array, dp: int, n: int, fill) -> jax.Array:
    """`x [dp · m, ...]` → each replica's rows padded with `fill` to n (≥ m) `[dp · n, ...]`."""
    y = x.reshape((dp, -1) + x.shape[1:])
    if y.shape[1] == n:
        return x
    y = jnp.pad(y, [(0, 0), (0, n - y.shape[1])] + [(0, 0)] * (y.ndim - 2), constant_values=fill)
    return y.reshape((-1,) + x.shape[1:])
