"""The per-step speculative inputs of the jitted step (host → device) and their builder.

A request verified this step has its rows laid out as `[t, d_1 … d_n]`: the last accepted token
`t` (a decode row) followed by its n drafts, all decode rows (never a prefill chunk, in every
layout). The step's target logits are taken at rows `sample_row + j`, j = 0 … k.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class SpecBatch:
    """Speculative-decoding inputs of one step (B request rows, T token rows, k drafts).

    sample_row_B: int32 `[B]` the row of each request's first sampled position (the decode token
        of a verified request, the last row of a prefill chunk that samples; 0 for others). Rows
        and `mtp_ids_T` are in token order (the host's; under data parallelism replica r's start
        at r · T); under PCP the step maps them to its load-balanced row order itself.
    draft_BK: int32 `[B, k]` the drafts verified (zeros past `num_draft_B`).
    num_draft_B: int32 `[B]` drafts verified per request (0 for prefill chunks and padding).
    valid_B: bool `[B]` requests whose chunk samples (they get tokens and new drafts).
    mtp_ids_T: int32 `[T]` the MTP input of each row: the token after it (the next scheduled
        token, or the next prompt token at the end of a chunk that does not sample; the device
        fills in the accepted token at each request's last accepted row).
    num_draft_steps: int32 scalar, drafts to propose for the next step (1 … k).
    """

    sample_row_B: jax.Array
    draft_BK: jax.Array
    num_draft_B: jax.Array
    valid_B: jax.Array
    mtp_ids_T: jax.Array
    num_draft_steps: jax.Array


def empty_spec_batch(T: int, B: int, k: int) -> SpecBatch:
    """Padding inputs (nothing verified, nothing drafted that anyone reads)."""
    return SpecBatch(np.zeros(B, np.int32), np.zeros((B, k), np.int32), np.zeros(B, np.int32),
                     np.zeros(B, bool), np.zeros(T, np.int32), np.int32(1))


def build_spec_batch(sched, T: int, B: int, k: int, num_draft_steps: int) -> SpecBatch:
    """The `SpecBatch` of a `SchedulerOutput` whose requests occupy rows in batch order (as
    `ModelRunner.prepare` lays them out), padded to T token rows and B request rows."""
    sb = empty_spec_batch(T, B, k)
    sb.num_draft_steps = np.int32(max(1, min(k, num_draft_steps)))
    off = 0
    for i, sr in enumerate(sched.scheduled):
        n, ns = sr.num_new_tokens, sr.num_spec_tokens
        toks = sr.token_ids
        if len(toks) == n:  # (else every row is fed from the step in flight: `serving.spec_decode.feed`)
            sb.mtp_ids_T[off:off + n - 1] = toks[1:]
            sb.draft_BK[i, :ns] = toks[n - ns:]
        if not sr.sample:  # a chunk that stops inside the known tokens: the next one is known
            sb.mtp_ids_T[off + n - 1] = sr.request.all_token_ids[sr.start_pos + n]
        sb.sample_row_B[i] = off + n - 1 - ns
        sb.num_draft_B[i] = ns
        sb.valid_B[i] = sr.sample
        off += n
    return sb


def stack_spec_batches(batches: list[SpecBatch], num_tokens: int) -> SpecBatch:
    """Data parallel: the replicas' `SpecBatch`es (each over `num_tokens` rows and B request rows,
    replica r's token rows at `r · num_tokens` of the stacked batch, `glm53.parallel_batch.
    stack_replicas`) as one, replica-major; `num_draft_steps` is the largest any replica asked for
    (a replica reads only its own count's drafts)."""
    cat = lambda xs: np.concatenate([np.asarray(x) for x in xs])
    rows = cat([b.sample_row_B + r * num_tokens for r, b in enumerate(batches)]).astype(np.int32)
    return SpecBatch(rows, cat([b.draft_BK for b in batches]), cat([b.num_draft_B for b in batches]),
                     cat([b.valid_B for b in batches]), cat([b.mtp_ids_T for b in batches]),
                     np.int32(max(int(b.num_draft_steps) for b in batches)))

