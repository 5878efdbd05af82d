"""The speculative part of the jitted step: target rows → verification → MTP drafts.

Called by `serving.runner.ModelRunner`'s step under MTP speculation instead of the plain
`forward + sample`; everything runs on the device, the host reads the outputs after the step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from glm53.mtp import propose_drafts
from glm53.sampling import apply_penalties
from serving.sampling import apply_token_bitmask, compute_logprobs, mask_unreachable
from serving.spec_decode.inputs import SpecBatch
from serving.spec_decode.rejection import verify_drafts


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
    # Every scheduled request has at least one row, so the first min(B, T) request rows hold them
    # all: verification and drafting run on those only (a batch-1 decode step of bucket k + 1 does
    # not verify and draft for max_num_seqs + 1 rows), and the outputs are padded back to B rows.
    B = min(B_all, T)
    sp = dataclasses.replace(sp, sample_row_B=sp.sample_row_B[:B], draft_BK=sp.draft_BK[:B],
                             num_draft_B=sp.num_draft_B[:B], valid_B=sp.valid_B[:B])
    sampling = tuple(x[:B] for x in sampling)
    rows_BS = jnp.clip(sp.sample_row_B[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :], 0, T - 1)
    logits = mask_unreachable(model.logits(h[rows_BS.reshape(-1)]), reachable)
    if bitmask_BSW is not None:
        logits = apply_token_bitmask(logits, bitmask_BSW[:B].reshape(B * S, -1))
    target = logits
    if pen is not None:  # entries of rows past B · S (requests cut above) are dropped
        target = apply_penalties(logits.astype(jnp.float32), *pen[:5], *(x[:B * S] for x in pen[5:]))
    tokens_BS, acc_B = verify_drafts(target.reshape(B, S, -1), sp.draft_BK, sp.num_draft_B, *sampling)
    L = num_logprobs

    def lps():
        t, i, v = compute_logprobs(logits, tokens_BS.reshape(-1), L)
        return t.reshape(B, S), i.reshape(B, S, L), v.reshape(B, S, L)

    def no_lps():
        return jnp.zeros((B, S), jnp.float32), jnp.zeros((B, S, L), jnp.int32), jnp.zeros((B, S, L), jnp.float32)

    lp = jax.lax.cond(want_logprobs, lps, no_lps)
    last_row_B = jnp.where(sp.valid_B, sp.sample_row_B + acc_B, 0)
    emitted_B = jnp.take_along_axis(tokens_BS, acc_B[:, None], axis=1)[:, 0]  # the token after the last accepted row
    mtp_ids = sp.mtp_ids_T.at[jnp.where(sp.valid_B, last_row_B, T)].set(emitted_B, mode="drop")
    drafts_BK, kv = propose_drafts(model, batch, mtp_ids, h, kv, layout, last_row_B=last_row_B, valid_B=sp.valid_B,
                                   num_steps=sp.num_draft_steps, k=k, reachable=reachable, parallel=parallel,
                                   host=host)
    pad = lambda x: jnp.pad(x, [(0, B_all - B)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    return tuple(pad(x) for x in (tokens_BS, acc_B, drafts_BK, *lp)), kv, h
