"""An oracle for prompt logprobs (serving/prompt_logprobs.py), independent of the engine's paged,
chunked step: one full forward of the prompt on a fresh cache (`glm53.api.forward`) and the
log-softmax of its logits in float64 over the reachable ids (tests/serving/test_prompt_logprobs.py,
tests/sharding/test_engine_dp.py, tests/sharding/test_engine_parallel.py)."""

from __future__ import annotations

import numpy as np

from glm53 import api

TOL = 2e-4  # logprobs: the engine's chunked, paged (or sharded) step against one full forward
TIE = 1e-4  # ids closer than this to each other may swap places in a ranking


def check_prompt_logprobs(lm, prompt: list[int], entries, k: int, reachable: int) -> None:
    """Assert the engine's prompt logprobs `entries` of `prompt` (k alternatives each) are the
    oracle's: None first, then per token its logprob to TOL, its rank within the oracle's ranks of
    the ids tied with it to TIE, and the top alternatives the oracle's k most likely up to such
    ties, their logprobs to TOL, most likely first."""
    logits = api.forward(lm, prompt).astype(np.float64)
    logits[:, reachable:] = -np.inf
    ref = logits - np.log(np.exp(logits[:, :reachable]).sum(-1, keepdims=True))
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e, row, tok = entries[i], ref[i - 1], prompt[i]
        assert e.token_id == tok and abs(e.logprob - row[tok]) < TOL, (i, e.logprob, row[tok])
        assert (row > row[tok] + TIE).sum() + 1 <= e.rank <= (row >= row[tok] - TIE).sum(), (i, e.rank)
        assert len(e.top) == k
        kth = np.sort(row)[::-1][k - 1] if k else None
        for tid, lp in e.top:
            assert abs(lp - row[tid]) < TOL and row[tid] >= kth - TIE, (i, tid, lp, row[tid], kth)
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
