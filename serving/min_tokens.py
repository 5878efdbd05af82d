"""`min_tokens` (vLLM's sampling parameter): a request may not stop before it generated that many
tokens. Its EOS ids (unless `ignore_eos`) and `stop_token_ids` are taken out of sampling through
the packed allowed-token bitmask that structured outputs already pass to the step
(`glm53.sampling.apply_token_bitmask`), so the ban works wherever those masks do: one device or
several, data parallelism, MTP verification rows, asynchronous scheduling. The front end skips
stop strings in the same stretch (`serving.output_processor.RequestTextState`) and the scheduler
does not stop on those ids before it (`Scheduler._stop_status`).

A request's output count at scheduling is `len(output_token_ids)` plus its in-flight placeholders
(asynchronous scheduling), so the mask is known when the step is scheduled: no step waits for
another because of it. Verification row j of a speculative step follows j more tokens.
"""

from __future__ import annotations

import numpy as np


def needs_ban(request, j: int = 0) -> bool:
    """True while `request`'s token at sampled position j (j drafts after its first) would be
    before its `min_tokens`."""
    sp = request.sampling_params
    emitted = len(request.output_token_ids) + request.num_output_placeholders
    return sp.min_tokens > 0 and emitted + j < sp.min_tokens


def banned_ids(request, eos_token_ids) -> list[int]:
    """The ids `request` may not sample before its `min_tokens`."""
    sp = request.sampling_params
    return sorted({*(() if sp.ignore_eos else eos_token_ids), *sp.stop_token_ids})


def apply_min_tokens(sched, bitmask: np.ndarray | None, num_rows: int, num_positions: int, num_words: int,
                     eos_token_ids) -> np.ndarray | None:
    """`sched`'s allowed-token masks (`SchedulerOutput.grammar_bitmask`: int32 `[num_rows,
    num_positions, num_words]` or None) with the `min_tokens` bans of its sampled rows cleared →
    the masks (a new all-ones array when `bitmask` is None and some row needs a ban), or
    `bitmask` unchanged when no row does. A position whose grammar allows nothing but the banned
    ids keeps them (an empty row would sample nothing)."""
    out = bitmask
    for i, sr in enumerate(sched.scheduled):
        if not sr.sample or sr.request.sampling_params.min_tokens <= 0:
            continue
        ids = np.asarray(banned_ids(sr.request, eos_token_ids), np.int64)
        ids = ids[(ids >= 0) & (ids < 32 * num_words)]
        for j in range(min(num_positions, sr.num_spec_tokens + 1)):
            if not needs_ban(sr.request, j) or not len(ids):
                continue
            if out is None:
                out = np.full((num_rows, num_positions, num_words), -1, np.int32)
            row = out[i, j].view(np.uint32)
            cleared = row.copy()
            np.bitwise_and.at(cleared, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
            if cleared.any():
                row[:] = cleared
    return out
