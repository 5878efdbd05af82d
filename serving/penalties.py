"""Presence, frequency and repetition penalties and `logit_bias` (vLLM's sampling parameters):
the host side. `glm53.sampling.apply_penalties` applies them on the device, in the sampler.

Each sampled row of a step that uses any of them touches a sparse list of ids — its `logit_bias`
keys, and for the penalties the distinct ids of its output so far (with their counts) and, for the
repetition penalty, of its prompt (`PenaltyState`, kept on the request and updated with each new
token). The step passes the entries of all its rows as one flat list of (row, id, count, in-prompt,
bias), padded to 64 · 4^n entries so that it takes few values (each is a sampler program, and a
whole step program under MTP speculation or on a multi-process engine); rows without
any get none (their factors are neutral). A step with such rows runs split in two, the forward
pass and then the sampler (`serving.step_program`: the programs asynchronous scheduling uses for
structured outputs), so each new length compiles only the small sampler program, on first use; a
multi-process engine, whose followers run whole steps, compiles a step variant per length instead.

A `thinking_token_budget` is one more entry of the list: the state keeps where the output is in
the think block, read as the reasoning parser reads it (one block: from the prompt's or a first
`<think>` to the first `</think>`), and how many tokens it spent there (`_think`); at a position where the
budget is spent and the block still open, the end id (`</think>`) gets a bias of `FORCE`, far
above any logit, so it is the token drawn (greedy or not) — the engine's form of vLLM's
thinking-budget logits processor. It depends on the output, as the penalties do — until the
output is known to be past the block: from then on the request needs no list (`budget_open`).

Output counts are those of the tokens the request has generated when the list is built. Under
asynchronous scheduling a request's last token may still be on the device then: a step after one
whose rows have output-dependent penalties (`output_dependent`) runs its sampler after that step
was read back (`serving.async_scheduling`, as for structured outputs), so the counts are complete.
Under MTP speculation (synchronous) each verification row j of a request gets its own counts: the
output plus the drafts before it, d_1 … d_j (the drafts are the step's scheduled tokens), as the
row's target distribution is the one the request would sample after those tokens.
"""

from __future__ import annotations

import numpy as np

from serving.parsers.reasoning import think_step

MIN_WIDTH = 64
FORCE = 1.0e4  # the bias that makes a token the one drawn (logits of a trained model are within ±100)


def counts_output(sp) -> bool:
    """True when `sp` (a `SamplingParams`) has a penalty that counts the output's ids."""
    return sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0


def budget_open(request) -> bool:
    """True while the request's thinking budget can still force a token: it has one, and its
    output is not known to be past the think block (once past, for good: `think_step`)."""
    if request.sampling_params.thinking_token_budget is None:
        return False
    state = request.penalty_state
    return state is None or state.phase != "content"


def uses_penalties(request) -> bool:
    """True when the request's sampled rows need the list: a penalty, a logit bias, or a
    thinking budget still open."""
    sp = request.sampling_params
    return bool(sp.logit_bias) or counts_output(sp) or budget_open(request)


def output_dependent(request) -> bool:
    """True when the request's adjustments depend on its output so far (the penalties and an open
    thinking budget; a logit bias alone does not)."""
    return counts_output(request.sampling_params) or budget_open(request)


def _think(phase: str, spent: int, t: int, tags) -> tuple[str, int]:
    """The think-block state after output token t: (phase, tokens spent inside the block), as
    the reasoning parser reads the output (`serving.parsers.reasoning.think_step`)."""
    phase, counted = think_step(phase, t, tags.opened, tags.start_id, tags.end_id)
    return phase, spent + counted


def _inside(phase: str, tags) -> bool:
    """Whether the next token is inside the think block."""
    return phase == "reasoning" or (phase == "start" and tags.opened)


def _width(n: int) -> int:
    w = MIN_WIDTH
    while w < n:
        w *= 4
    return w


class PenaltyState:
    """One request's sparse list, kept up to date as its output grows (`Request.penalty_state`), so
    a step costs the new tokens, not the whole output or prompt again (a long reasoning output or
    a long prompt under the repetition penalty would otherwise be a pass over thousands of ids per
    request per step).

    ids: int32 [L] sorted distinct ids (the bias keys; for the penalties the output's ids and, for
    the repetition penalty, the prompt's). counts: int32 [L] their output counts. in_prompt: bool
    [L]. bias: fp32 [L]. counted: output tokens already counted (the output only grows)."""

    def __init__(self, request):
        sp = request.sampling_params
        self.counting = counts_output(sp)
        self.budget, self.tags = sp.thinking_token_budget, sp.reasoning_tags
        self.phase, self.spent = "start", 0
        bias = {int(k): float(v) for k, v in (sp.logit_bias or {}).items()}
        if self.budget is not None:
            bias.setdefault(int(self.tags.end_id), 0.0)  # its column: forced where the budget is spent
        prompt = np.unique(np.asarray(request.prompt_token_ids, np.int64)) if sp.repetition_penalty != 1.0 \
            else np.zeros(0, np.int64)
        self.ids = np.union1d(prompt, np.fromiter(bias, np.int64, len(bias))).astype(np.int32)
        self.in_prompt = np.isin(self.ids, prompt)
        self.bias = np.asarray([bias.get(int(i), 0.0) for i in self.ids], np.float32)
        self.counts = np.zeros(len(self.ids), np.int32)
        self.counted = 0

    def _column(self, t: int) -> int:
        """The column of id t, inserted (count 0, not in the prompt, no bias) when new."""
        c = int(np.searchsorted(self.ids, t))
        if c == len(self.ids) or self.ids[c] != t:
            self.ids = np.insert(self.ids, c, t)
            self.counts = np.insert(self.counts, c, 0)
            self.in_prompt = np.insert(self.in_prompt, c, False)
            self.bias = np.insert(self.bias, c, np.float32(0))
        return c

    def update(self, output_token_ids) -> None:
        """Count the output tokens not counted yet."""
        for t in output_token_ids[self.counted:]:
            if self.counting:
                c = self._column(int(t))  # (may replace self.counts: index it after)
                self.counts[c] += 1
            if self.budget is not None:
                self.phase, self.spent = _think(self.phase, self.spent, int(t), self.tags)
        self.counted = len(output_token_ids)

    def _forced(self, drafts) -> list[bool]:
        """Per position j (the output and `drafts[:j]`): whether the thinking budget forces the end id."""
        if self.budget is None:
            return [False]
        phase, spent, out = self.phase, self.spent, []
        for j in range(len(drafts) + 1):
            out.append(_inside(phase, self.tags) and spent >= self.budget)
            if j < len(drafts):
                phase, spent = _think(phase, spent, int(drafts[j]), self.tags)
        return out

    def entries(self, drafts=()) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """→ (ids int32 [L], counts int32 [P, L], in_prompt bool [L], bias fp32 [P', L]) with P =
        len(drafts) + 1 positions, position j counting the output and `drafts[:j]` (P' = P when
        the thinking budget forces the end id at some position, else 1: the same bias for all)."""
        forced = self._forced(drafts)
        ids, counts, in_prompt, bias = self.ids, self.counts, self.in_prompt, self.bias
        if any(forced):
            bias = np.repeat(bias[None, :], len(forced), axis=0)
            bias[np.asarray(forced), int(np.searchsorted(ids, self.tags.end_id))] += np.float32(FORCE)
        else:
            bias = bias[None, :]
        drafts = np.asarray([int(t) for t in drafts] if self.counting else [], np.int32)
        if not len(drafts):
            return ids, counts[None, :], in_prompt, bias
        new = np.setdiff1d(drafts, ids)  # drafts' ids not in the list: columns for this step only
        if len(new):
            at = np.searchsorted(ids, new)
            ids, counts = np.insert(ids, at, new), np.insert(counts, at, 0)
            in_prompt, bias = np.insert(in_prompt, at, False), np.insert(bias, at, np.float32(0), axis=1)
        per_pos = np.repeat(counts[None, :], len(drafts) + 1, axis=0)
        for j, c in enumerate(np.searchsorted(ids, drafts)):
            per_pos[j + 1:, c] += 1
        return ids, per_pos, in_prompt, bias


def row_entries(request, drafts=()) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One request's sparse list (`PenaltyState.entries`), its state brought up to date with its
    output first (created on first use, kept on the request)."""
    if request.penalty_state is None:
        request.penalty_state = PenaltyState(request)
    request.penalty_state.update(request.output_token_ids)
    return request.penalty_state.entries(drafts)


def step_penalties(scheds, rows_per_replica: int, positions: int = 0) -> tuple | None:
    """The adjustments of a step's sampled rows → the arguments of `glm53.sampling.apply_penalties`
    after the logits, as numpy (row, ids, counts int32 [E], in_prompt bool [E], bias fp32 [E];
    presence, frequency, repetition fp32 [R]), or None when no sampled row uses any. Rows are
    replica-major like the step's request rows (replica r's start at r · rows_per_replica), R of
    them in all.

    positions: 0 without speculation. Under MTP speculation k + 1: the logits rows are then
    request b's verification rows b · (k + 1) + j, and row j counts the output and the drafts
    before it (positions past a request's drafts repeat its last); R = requests · (k + 1)."""
    rows = {}
    for r, sched in enumerate(scheds):
        for i, sr in enumerate(sched.scheduled):
            if sr.sample and uses_penalties(sr.request):
                ns = sr.num_spec_tokens if positions else 0
                rows[r * rows_per_replica + i] = (sr.request, sr.token_ids[len(sr.token_ids) - ns:] if ns else ())
    if not rows:
        return None
    S = max(positions, 1)
    R = rows_per_replica * len(scheds) * S
    presence = np.zeros(R, np.float32)
    frequency = np.zeros(R, np.float32)
    repetition = np.ones(R, np.float32)
    parts = []
    for row, (req, drafts) in rows.items():
        ids, per_pos, in_prompt, bias = row_entries(req, drafts)
        sp = req.sampling_params
        for j in range(S):
            n = row * S + j
            parts.append((np.full(len(ids), n, np.int32), ids, per_pos[min(j, len(per_pos) - 1)], in_prompt,
                          bias[min(j, len(bias) - 1)]))
            presence[n], frequency[n], repetition[n] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
    E = _width(sum(len(p[1]) for p in parts))
    out = [np.full(E, -1, np.int32), np.zeros(E, np.int32), np.zeros(E, np.int32), np.zeros(E, bool),
           np.zeros(E, np.float32)]
    for k, arr in enumerate(out):
        flat = np.concatenate([p[k] for p in parts])
        arr[:len(flat)] = flat
    return (*out, presence, frequency, repetition)


def empty_penalties(rows: int, entries: int = MIN_WIDTH) -> tuple:
    """`step_penalties`' arrays with no entry (rows −1) and neutral factors, for `rows` logits rows:
    the shapes a background compile lowers the penalised sampler with (`serving.runner_variants`)."""
    return (np.full(entries, -1, np.int32), np.zeros(entries, np.int32), np.zeros(entries, np.int32),
            np.zeros(entries, bool), np.zeros(entries, np.float32), np.zeros(rows, np.float32),
            np.zeros(rows, np.float32), np.ones(rows, np.float32))
