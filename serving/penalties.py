"""Presence, frequency and repetition penalties and `logit_bias` (vLLM's sampling parameters):
the host side. `glm53.sampling.apply_penalties` applies them on the device, in the sampler.

Each sampled row of a step that uses any of them gets a sparse list of the ids it touches — its
`logit_bias` keys, and for the penalties the distinct ids of its output so far (with their counts)
and, for the repetition penalty, of its prompt — padded to a power-of-two width (at least 64) so
that a step's list width takes few values. A step with such rows runs split in two, the forward
pass and then the sampler (`serving.step_program`: the programs asynchronous scheduling uses for
structured outputs), so each new width compiles only the small sampler program, on first use; a
multi-process engine, whose followers run whole steps, compiles a step variant per width instead.
Rows without any of them get an empty list and neutral factors.

Output counts are those of the tokens the request has generated when the list is built. Under
asynchronous scheduling a request's last token may still be on the device then: a step after one
whose rows have output-dependent penalties (`output_dependent`) runs its sampler after that step
was read back (`serving.async_scheduling`, as for structured outputs), so the counts are complete.
Under MTP speculation (synchronous) each verification row j of a request gets its own counts: the
output plus the drafts before it, d_1 … d_j (the drafts are the step's scheduled tokens), as the
row's target distribution is the one the request would sample after those tokens.
"""

from __future__ import annotations

import collections

import numpy as np

MIN_WIDTH = 64


def uses_penalties(sp) -> bool:
    """True when `sp` (a `SamplingParams`) asks for a penalty or a logit bias."""
    return bool(sp.logit_bias) or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 \
        or sp.repetition_penalty != 1.0


def output_dependent(sp) -> bool:
    """True when `sp`'s adjustments depend on the request's output so far (the penalties; a logit
    bias alone does not)."""
    return sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0


def _width(n: int) -> int:
    w = MIN_WIDTH
    while w < n:
        w *= 2
    return w


def row_entries(request, drafts=()) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One request's sparse list → (ids int32 [L], output counts int32 [P, L], in-prompt bool [L],
    bias fp32 [L]), ids sorted and distinct; P = len(drafts) + 1 positions, position j counting the
    output and the drafts before it (`drafts[:j]`)."""
    sp = request.sampling_params
    counts: collections.Counter = collections.Counter()
    prompt: set[int] = set()
    drafts = [int(t) for t in drafts] if output_dependent(sp) else []
    if output_dependent(sp):
        counts = collections.Counter(int(t) for t in request.output_token_ids)
        if sp.repetition_penalty != 1.0:
            prompt = {int(t) for t in request.prompt_token_ids}
    bias = {int(k): float(v) for k, v in (sp.logit_bias or {}).items()}
    ids = np.asarray(sorted(set(counts) | set(drafts) | prompt | set(bias)), np.int32)
    col = {int(t): c for c, t in enumerate(ids)}
    per_pos = np.zeros((len(drafts) + 1, len(ids)), np.int32)
    per_pos[:] = [counts.get(int(i), 0) for i in ids]
    for j, t in enumerate(drafts):
        per_pos[j + 1:, col[t]] += 1
    return (ids, per_pos, np.asarray([int(i) in prompt for i in ids], bool),
            np.asarray([bias.get(int(i), 0.0) for i in ids], np.float32))


def step_penalties(scheds, rows_per_replica: int, positions: int = 0) -> tuple | None:
    """The adjustments of a step's sampled rows, replica-major like its request rows (replica r's
    rows start at r · rows_per_replica) → the arguments of `glm53.sampling.apply_penalties` after
    the logits, as numpy: ids int32 [R, L], counts int32 [R, L], in_prompt bool [R, L], bias fp32
    [R, L], presence, frequency, repetition fp32 [R]; None when no sampled row uses any.

    positions: 0 without speculation; under MTP speculation k + 1, and the four lists are
    [R, k + 1, L] (verification row j of a request: its counts after the drafts before it;
    positions past a request's drafts repeat its last)."""
    rows = {}
    for r, sched in enumerate(scheds):
        for i, sr in enumerate(sched.scheduled):
            if sr.sample and uses_penalties(sr.request.sampling_params):
                ns = sr.num_spec_tokens if positions else 0
                rows[r * rows_per_replica + i] = (sr.request, sr.token_ids[len(sr.token_ids) - ns:] if ns else ())
    if not rows:
        return None
    R = rows_per_replica * len(scheds)
    entries = {row: row_entries(req, drafts) for row, (req, drafts) in rows.items()}
    L = _width(max(len(e[0]) for e in entries.values()))
    S = max(positions, 1)
    ids = np.full((R, S, L), -1, np.int32)
    counts = np.zeros((R, S, L), np.int32)
    in_prompt = np.zeros((R, S, L), bool)
    bias = np.zeros((R, S, L), np.float32)
    presence = np.zeros(R, np.float32)
    frequency = np.zeros(R, np.float32)
    repetition = np.ones(R, np.float32)
    for row, (i, c, p, b) in entries.items():
        n = len(i)
        ids[row, :, :n], in_prompt[row, :, :n], bias[row, :, :n] = i, p, b
        counts[row, :len(c), :n] = c
        counts[row, len(c):, :n] = c[-1]
        sp = rows[row][0].sampling_params
        presence[row], frequency[row], repetition[row] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
    if not positions:
        ids, counts, in_prompt, bias = ids[:, 0], counts[:, 0], in_prompt[:, 0], bias[:, 0]
    return ids, counts, in_prompt, bias, presence, frequency, repetition
