"""Asynchronous scheduling under MTP speculation: a step's inputs taken from the step in flight.

While step n runs, the scheduler builds step n+1 for a request that step n verifies as if step n
accepted none of its drafts (`serving.scheduler`): its rows are `[e, d'_1 … d'_m]` — the token
step n emits after its accepted drafts, then the first m of the drafts step n proposes — at
positions `p + 1 … p + 1 + m`, where p is step n's decode position. None of those tokens is known
on the host. Before step n+1 runs, `apply_spec_feed` takes them from step n's outputs on the
device and moves the rows by the a drafts step n accepted:

* input id of row j: `e = tokens[a]` for j = 0, `drafts[j − 1]` after it;
* position: + a; slot of every KV group: recomputed from the block table at the new position
  (−1 past the table or on a null page, which writes nothing: a request that step n finished is
  computed once more and dropped, `docs/async_scheduling.md`);
* the `SpecBatch`: the drafts verified (`draft_BK`; their number cut to what the length limit and
  `max_tokens` leave after the a accepted tokens, as a synchronous step would verify), the MTP
  inputs of the rows (`mtp_ids_T`, row j's is the token after it, `drafts[j]`); the sampler's step
  counter (`steps_B`, tokens generated so far: its seeded draws are keyed by it) + a.

`spec_feed_plan` builds the host side: which rows and request rows take what from which row of
step n's outputs. The same scheme as vLLM's asynchronous scheduler with speculation (it keeps
1 + k output placeholders per request and the model runner overwrites the stale inputs) and
tpu-inference's JAX runner (placeholder tokens substituted and rejected drafts subtracted from
positions on the device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def spec_feed_plan(sched, num_tokens: int, num_rows: int, prev_rows: dict) -> tuple | None:
    """The feed of one replica's step (`sched`, token rows in batch order padded to `num_tokens`,
    request rows to `num_rows`) from the step in flight, whose output row for request id r is
    `prev_rows[r]` → `(src_T, j_T, mtp_src_T, mtp_j_T, src_B, limit_B)`, all int32 in the host's
    token and request order, −1 where nothing is fed; None when no row is fed:

    * `src_T[i]`, `j_T[i]`: token row i takes the emitted token (j = 0) or draft j − 1 of output
      row `src_T[i]`;
    * `mtp_src_T[i]`, `mtp_j_T[i]`: row i's MTP input is draft `mtp_j_T[i]` of that output row;
    * `src_B[b]`: request row b's drafts, accepted count and step counter come from that row;
      `limit_B[b]`: its `ScheduledRequest.spec_limit` (it verifies min(its drafts, limit −
      accepted), as a synchronous step would).

    A fed request is one whose tokens are not all known (`ScheduledRequest.token_ids` is short):
    then none of its rows is, and it has exactly 1 + `num_spec_tokens` rows (the scheduler's
    asynchronous MTP rule). Raises ValueError otherwise, or when the step in flight does not
    sample the request."""
    plan = None
    off = 0
    for b, sr in enumerate(sched.scheduled):
        n = sr.num_new_tokens
        missing = n - len(sr.token_ids)
        if missing:
            row = prev_rows.get(sr.request_id)
            if row is None or missing != n or n != 1 + sr.num_spec_tokens:
                raise ValueError(f"request {sr.request_id!r}: {missing} of {n} input tokens not known "
                                 f"({sr.num_spec_tokens} drafts), and the step in flight does not sample them")
            if plan is None:
                plan = (tuple(np.full(num_tokens, -1, np.int32) for _ in range(4))
                        + tuple(np.full(num_rows, -1, np.int32) for _ in range(2)))
            src_T, j_T, msrc_T, mj_T, src_B, limit_B = plan
            src_T[off:off + n] = row
            j_T[off:off + n] = np.arange(n)
            msrc_T[off:off + n - 1] = row  # row j's MTP input is draft j (the last row's: on the device)
            mj_T[off:off + n - 1] = np.arange(n - 1)
            src_B[b] = row
            limit_B[b] = sr.num_spec_tokens if sr.spec_limit is None else sr.spec_limit
        off += n
    return plan


def apply_spec_feed(ids_T, pos_T, req_T, slots: dict, tables: dict, steps_B, sp, feed: tuple, prev: tuple, *,
                    tokens_per_page: dict, dp: int):
    """The step's inputs with the fed rows filled in from the step in flight (module docstring).

    Args:
      ids_T, pos_T, req_T: int32 [T] the placed batch's input ids, positions and request rows
        (local to the replica: DP replicas are stacked, T / dp rows each, in order).
      slots, tables: per KV group, int32 [T] engine slots and [dp · B, P] block tables.
      steps_B: int32 [dp · B] the sampler's step counters. sp: the `SpecBatch` (host token order).
      feed: `(src_T, j_T, mtp_src_T, mtp_j_T, src_B, limit_B)` of `spec_feed_plan`, the first two in the
        placed order, the others in the host's (replicas stacked).
      prev: the step in flight's `(tokens_BS, num_accepted_B, drafts_BK)`.
      tokens_per_page: per group, the tokens of one engine page (× DCP).
      dp: data-parallel replicas.

    Returns `(ids_T, pos_T, slots, steps_B, sp)`.
    """
    src_T, j_T, msrc_T, mj_T, src_B, limit_B = feed
    toks_BS, acc_B, drafts_BK = prev
    K = drafts_BK.shape[1]
    fed = src_T >= 0
    s = jnp.maximum(src_T, 0)
    a_T = acc_B[s]
    emitted = jnp.take_along_axis(toks_BS[s], a_T[:, None], axis=1)[:, 0]
    draft = drafts_BK[s, jnp.clip(j_T - 1, 0, K - 1)]
    ids_T = jnp.where(fed, jnp.where(j_T == 0, emitted, draft), ids_T).astype(ids_T.dtype)
    pos_T = jnp.where(fed, pos_T + a_T, pos_T).astype(pos_T.dtype)
    T = ids_T.shape[0]
    replica_T = jnp.arange(T, dtype=jnp.int32) // (T // dp)
    new_slots = {}
    for g, slot_T in slots.items():
        table = tables[g]
        P, tpp = table.shape[1], tokens_per_page[g]
        page = pos_T // tpp
        block = table[replica_T * (table.shape[0] // dp) + req_T, jnp.minimum(page, P - 1)]
        moved = jnp.where((page < P) & (block != 0), block * tpp + pos_T % tpp, -1)
        new_slots[g] = jnp.where(fed, moved, slot_T).astype(slot_T.dtype)
    b = jnp.maximum(src_B, 0)
    has_b = src_B >= 0
    a_B = acc_B[b]
    num_draft_B = jnp.where(has_b, jnp.clip(jnp.minimum(sp.num_draft_B, limit_B - a_B), 0, None),
                            sp.num_draft_B).astype(sp.num_draft_B.dtype)
    k_idx = jnp.arange(sp.draft_BK.shape[1])
    take = has_b[:, None] & (k_idx[None, :] < num_draft_B[:, None])
    draft_BK = jnp.where(take, drafts_BK[b][:, : sp.draft_BK.shape[1]], sp.draft_BK).astype(sp.draft_BK.dtype)
    mtp_ids_T = jnp.where(msrc_T >= 0, drafts_BK[jnp.maximum(msrc_T, 0), jnp.clip(mj_T, 0, K - 1)],
                          sp.mtp_ids_T).astype(sp.mtp_ids_T.dtype)
    steps_B = jnp.where(has_b, steps_B + a_B, steps_B).astype(steps_B.dtype)
    sp = type(sp)(sp.sample_row_B, draft_BK, num_draft_B, sp.valid_B, mtp_ids_T, sp.num_draft_steps)
    return ids_T, pos_T, new_slots, steps_B, sp


def spec_feed_program(tokens_per_page: dict, dp: int, out_shardings, fed: bool = True):
    """`apply_spec_feed` jitted with its outputs `(ids_T, pos_T, slots, steps_B, sp)` on
    `out_shardings`; with `fed` False a program of the same outputs that takes the step's own
    arrays (no feed, no previous outputs) and returns them unchanged. Every speculative step's
    inputs go through one of the two, so the step takes them in one form fed or not (one compiled
    step program)."""
    if fed:
        return jax.jit(lambda *a: apply_spec_feed(*a, tokens_per_page=tokens_per_page, dp=dp),
                       out_shardings=out_shardings)
    return jax.jit(lambda ids, pos, req, slots, tables, steps, sp: (ids, pos, slots, steps, sp),
                   out_shardings=out_shardings)
