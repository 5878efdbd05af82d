"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt token after the
first, its log-probability given the tokens before it, its rank and the k most likely tokens.

The logits that predict prompt token p + 1 are those of position p, which the prefill computes
anyway; only the request's last token's logits reach the sampler. A step that prefills positions
of such a request passes its program (the whole step, the speculative one under MTP, or the split
forward pass: `serving.step_program`) the rows' indices in the step's hidden states and the prompt
tokens they predict (`step_rows`; a variant of the program, as structured outputs' mask), and the
program computes the logprobs of those rows from the hidden states in blocks
(`glm53.sampling.prompt_token_logprobs`). A multi-process engine's followers get the rows with the
step's inputs (`StepInputs.prompt_rows`); the leader reads the outputs. The runner writes what comes back into
the request's `PromptLogprobs` by position (`record`), so a chunk computed again (a HiSparse chunk
cut short, a preempted request) overwrites what it wrote before; the engine hands the whole list to
the request's first output with a token (`take_prompt_logprobs`).

What the request gives up (as in vLLM): prefix-cache hits, device or host tier (its positions must
be computed to have logits), so `PrefixCache.lookup` finds nothing for it. Refused with P/D's
`kv_transfer_params` (a decode engine never computes the prompt).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from serving.request import Request
from serving.types import TokenLogprobs
from sharding.context_parallel import pcp_placed_rows

logger = logging.getLogger(__name__)


def wants_prompt_logprobs(req: Request) -> bool:
    """True while the request asked for prompt logprobs and has not had them yet."""
    return req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_sent


class PromptLogprobs:
    """One request's prompt logprobs so far: position p (0 ≤ p < prompt length − 1) holds the
    logprob of prompt token p + 1 (fp32), its rank (int32) and the top `k` ids and logprobs."""

    def __init__(self, num_prompt_tokens: int, k: int) -> None:
        n = max(0, num_prompt_tokens - 1)
        self.logprob = np.zeros(n, np.float32)
        self.rank = np.zeros(n, np.int32)
        self.top_ids = np.zeros((n, k), np.int32)
        self.top_logprobs = np.zeros((n, k), np.float32)
        self.written = np.zeros(n, bool)

    def write(self, first: int, logprob, rank, top_ids, top_logprobs) -> None:
        """Positions first … first + len(logprob) − 1 (a later write of a position replaces it)."""
        sl = slice(first, first + len(logprob))
        k = self.top_ids.shape[1]
        self.logprob[sl], self.rank[sl] = logprob, rank
        self.top_ids[sl], self.top_logprobs[sl] = top_ids[:, :k], top_logprobs[:, :k]
        self.written[sl] = True

    def entries(self, prompt_token_ids: list[int]) -> list[TokenLogprobs | None]:
        """One entry per prompt token: None for the first, then `TokenLogprobs(token, logprob,
        top, rank)`. A position never computed (an engine path that skipped it: a bug) is None too,
        logged as an error, so that the request and the engine go on."""
        out: list[TokenLogprobs | None] = [None]
        if not self.written.all():
            missing = np.flatnonzero(~self.written)
            logger.error("prompt logprobs of %d positions were never computed (the first: %d); they are null",
                         len(missing), int(missing[0]))
        for p in range(len(self.logprob)):
            if not self.written[p]:
                out.append(None)
                continue
            top = [(int(i), float(v)) for i, v in zip(self.top_ids[p], self.top_logprobs[p]) if v > -np.inf]
            out.append(TokenLogprobs(int(prompt_token_ids[p + 1]), float(self.logprob[p]), top, int(self.rank[p])))
        return out


@dataclass
class PromptLogprobRows:
    """A step's prompt-logprob rows: rows_P int32 [P] (indices into the step's hidden states, in
    the placed token order; P = the step's token rows over all replicas, padded with 0), targets_P
    int32 [P] (the prompt token each row predicts), count (int32: the real rows, first), and spans:
    (request, first position, first row in rows_P, count) per request."""

    rows_P: np.ndarray
    targets_P: np.ndarray
    count: np.int32
    spans: list[tuple[Request, int, int, int]]

    @property
    def arrays(self) -> tuple:
        """(rows_P, targets_P, count): what the step program takes (`StepInputs.prompt_rows`)."""
        return self.rows_P, self.targets_P, self.count


def step_rows(scheds, num_tokens: int, pcp: int = 1) -> PromptLogprobRows | None:
    """The prompt-logprob rows of a step over `scheds` (one `SchedulerOutput` per DP replica, each
    padded to `num_tokens` token rows; replica r's rows are the r-th slice, PCP-reordered within it
    as `glm53.parallel_batch.pcp_reorder` places them) → None when no scheduled request wants them.
    A chunk at positions s … s + n − 1 of a prompt of length L contributes positions s … min(s + n,
    L − 1) − 1 (the last prompt token predicts the first output token, not a prompt token)."""
    spans, rows, targets = [], [], []
    placed_rows = pcp_placed_rows(num_tokens, pcp) if pcp > 1 else None
    num_rows = 0
    for r, sched in enumerate(scheds):
        off = 0
        for sr in sched.scheduled:
            req, n = sr.request, sr.num_new_tokens
            if wants_prompt_logprobs(req):
                s = sr.start_pos
                count = min(s + n, req.num_prompt_tokens - 1) - s
                if count > 0:
                    local = off + np.arange(count)
                    placed = (placed_rows[local] if placed_rows is not None else local) + r * num_tokens
                    spans.append((req, s, num_rows, count))
                    num_rows += count
                    rows.append(placed.astype(np.int32))
                    targets.append(np.asarray(req.prompt_token_ids[s + 1:s + 1 + count], np.int32))
            off += n
    if not spans:
        return None
    P = len(scheds) * num_tokens
    rows_P = np.zeros(P, np.int32)
    targets_P = np.zeros(P, np.int32)
    flat = np.concatenate(rows)
    rows_P[:len(flat)] = flat
    targets_P[:len(flat)] = np.concatenate(targets)
    return PromptLogprobRows(rows_P, targets_P, np.int32(len(flat)), spans)


def record(plan: PromptLogprobRows, outputs) -> None:
    """Write a step's prompt-logprob outputs (numpy: logprob [P], rank [P], top ids [P, k], top
    logprobs [P, k]) into each request's `PromptLogprobs` (created on first use)."""
    lp, rank, ids, lps = outputs
    for req, first, row0, count in plan.spans:
        buf = req.prompt_logprobs_buf
        if buf is None:
            buf = req.prompt_logprobs_buf = PromptLogprobs(req.num_prompt_tokens, req.sampling_params.prompt_logprobs)
        sl = slice(row0, row0 + count)
        buf.write(first, lp[sl], rank[sl], ids[sl], lps[sl])


def take_prompt_logprobs(req: Request) -> list[TokenLogprobs | None] | None:
    """The request's prompt logprobs, once (its first output with a token): the list of
    `PromptLogprobs.entries`, after which the request no longer computes them (a preempted request
    recomputing its prompt does not send them again). None when it did not ask, or had them."""
    if not wants_prompt_logprobs(req):
        return None
    buf = req.prompt_logprobs_buf
    if buf is None:  # a one-token prompt: nothing to predict
        buf = PromptLogprobs(req.num_prompt_tokens, req.sampling_params.prompt_logprobs)
    out = buf.entries(req.prompt_token_ids)
    req.prompt_logprobs_sent = True
    req.prompt_logprobs_buf = None
    return out
