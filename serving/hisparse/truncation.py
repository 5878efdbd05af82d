"""Truncated steps under Hybrid HiSparse's adaptive prefill sizing (docs/hisparse.md "Long prefills").

A prefill chunk of a request with pages off the device may be given more query rows than its
lease can serve in the worst case (`residency.py`, `prefill_sizing: "adaptive"`). When its
selections overflow the lease, the resolver drops the last misses in first-occurrence order
(query row, then top-k order), so every query row before the first one with a dropped selection
read exactly what the device-resident step reads, and so did the KV it wrote: attention is
causal, and a row's hidden state depends only on rows at or before it. The step reports that
position per request (`HotState.first_drop_S` → `HiSparseDeviceState.truncations`), and
`truncate_step` rewrites the step's schedule as if the request had been given only the rows
before it: its `num_computed_tokens` advances to that position, it samples nothing, and the rest
of the chunk is computed again by the next step. The rows past the position wrote KV slots that
nothing reads before they are written again (queries only select positions at or before their
own, pages are sealed, cached and offloaded only up to `num_computed_tokens`).

A truncated request that verified MTP drafts, or a decode row (neither is sized past the worst
case, so this does not happen), keeps nothing of the step and is run again.
"""

from __future__ import annotations

import dataclasses

from serving.scheduler_output import SchedulerOutput


def truncate_step(sched: SchedulerOutput, sampled: dict[str, list[int]],
                  truncated: dict[str, int]) -> tuple[SchedulerOutput, dict[str, list[int]], dict[str, int]]:
    """The step's schedule and sampled tokens with each request of `truncated` (request id → the
    position its chunk is valid up to) cut there.

    Returns `(schedule, sampled, kept)`: a copy of `sched` whose truncated entries have
    `num_new_tokens` = the rows kept, `sample` False and no drafts; `sampled` without their
    tokens; `kept` request id → rows kept (for the policy's estimate). Nothing is changed when
    `truncated` is empty."""
    if not truncated:
        return sched, sampled, {}
    scheduled, kept = [], {}
    sampled = dict(sampled)
    for sr in sched.scheduled:
        first = truncated.get(sr.request_id)
        if first is None or first >= sr.start_pos + sr.num_new_tokens:
            scheduled.append(sr)
            continue
        keep = max(0, first - sr.start_pos)
        if sr.num_spec_tokens:
            keep = 0
        kept[sr.request_id] = keep
        sampled.pop(sr.request_id, None)
        scheduled.append(dataclasses.replace(sr, num_new_tokens=keep, sample=False, num_spec_tokens=0))
    out = dataclasses.replace(sched, scheduled=scheduled,
                              num_scheduled_tokens=sum(sr.num_new_tokens for sr in scheduled))
    return out, sampled, kept
