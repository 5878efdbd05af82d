"""docs/design.md §10's equality rule for greedy token streams of two runs that should compute the same
thing (a HiSparse or preemption run vs an ample-pool run, a parallel layout vs one device).

Streams must be identical, except that a stream may diverge at a near-tie: at the first differing
token, either the reference's top-2 logit gap (from its top-2 logprobs: log-softmax keeps logit
differences) is below `eps_logit`, or the smallest k-th vs (k+1)-th indexer score gap over that
step's full layers is below `eps_index` (a recompute after preemption, or another chunking, can
move an indexer top-k boundary near-tie without any final-logit near-tie). Every divergence is
reported with both gaps and the rule that accepted it; an unexplained one fails.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp

EPS_LOGIT = 1e-4  # fp32 logits; prefill vs decode of a token differ by ~1e-6
EPS_INDEX = 1e-3  # indexer scores are O(1) sums of 4 heads' ReLU dots; the same ~1e-6 noise moves them


@dataclass
class Divergence:
    """A stream that left the reference at output token `index`."""

    key: object
    index: int
    logit_gap: float
    index_gap: float | None
    accepted_by: str | None  # "logit", "indexer" or None (unexplained)

    def __str__(self) -> str:
        ig = "n/a" if self.index_gap is None else f"{self.index_gap:.3g}"
        return (f"{self.key}: diverges at output token {self.index}; top-2 logit gap {self.logit_gap:.3g}, "
                f"indexer boundary gap {ig} -> {self.accepted_by or 'UNEXPLAINED'}")


@contextlib.contextmanager
def _record_indexer_gaps(out: list[float]):
    """Within the context, every full layer's indexer also computes its (k+1)-th score and
    reports, for the last query row, the gap between its k-th and (k+1)-th scores."""
    import glm53.attention as attn
    from kernels.indexer_topk import indexer_topk

    orig = attn.indexer_topk

    def with_gap(*args, topk, return_scores=False, **kw):
        idx, valid, score = indexer_topk(*args, topk=topk + 1, return_scores=True, **kw)
        gap = jnp.where(valid[-1] > topk, score[-1, topk - 1] - score[-1, topk], jnp.inf)
        jax.debug.callback(lambda g: out.append(float(g)), gap)
        res = (idx[:, :topk], jnp.minimum(valid, topk))
        return res + (score[:, :topk],) if return_scores else res

    attn.indexer_topk = with_gap
    try:
        yield
    finally:
        attn.indexer_topk = orig


def indexer_boundary_gap(lm, token_ids) -> float:
    """The smallest k-th vs (k+1)-th indexer score gap, over the full layers, of the last token
    of `token_ids` prefilled from scratch (`glm53.api.forward`); inf when no layer has more than
    k candidates."""
    from glm53.inspect import forward_fresh

    gaps: list[float] = []
    with _record_indexer_gaps(gaps):
        forward_fresh(lm, token_ids)
    return min(gaps) if gaps else float("inf")


def top2_gap(token_logprobs) -> float:
    """Top-2 logit gap of one sampled token: from an object with `.top` (`(id, logprob)` pairs,
    like serving's `TokenLogprobs`), a list of logprobs, or the gap itself (a float)."""
    if isinstance(token_logprobs, (int, float)):
        return float(token_logprobs)
    vals = [lp for _, lp in token_logprobs.top] if hasattr(token_logprobs, "top") else list(token_logprobs)
    top = sorted(vals, reverse=True)
    return float(top[0] - top[1]) if len(top) >= 2 else float("inf")


def compare_streams(ref: dict, got: dict, ref_logprobs: dict, contexts: dict, lm=None, *,
                    eps_logit: float = EPS_LOGIT, eps_index: float = EPS_INDEX, strict: bool = True,
                    verbose: bool = True) -> list[Divergence]:
    """Check `got[key]` against `ref[key]` (lists of token ids) under the equality rule.

    ref_logprobs[key][i]: the reference's top-2 logprobs of token i (see `top2_gap` for the
    accepted forms). contexts[key]: the token ids before the stream (the prompt), for the
    indexer diagnostic (needs `lm`, a `glm53.api.LoadedModel` with the runs' cache dtype; without
    it only the logit rule applies). Returns every divergence (printed when `verbose`); with
    `strict`, raises AssertionError listing them when one is unexplained or a stream is missing.
    """
    divs = []
    for key, want in ref.items():
        have = got.get(key)
        if have is None:
            assert not strict, f"{key}: missing from the compared run"
            divs.append(Divergence(key, 0, float("inf"), None, None))
            continue
        if have == want:
            continue
        i = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        lg = top2_gap(ref_logprobs[key][i]) if i < len(ref_logprobs.get(key, ())) else float("inf")
        d = Divergence(key, i, lg, None, "logit" if lg < eps_logit else None)
        if d.accepted_by is None and lm is not None and i < len(want):
            d.index_gap = indexer_boundary_gap(lm, list(contexts[key]) + list(want[:i]))
            d.accepted_by = "indexer" if d.index_gap < eps_index else None
        divs.append(d)
    if verbose:
        for d in divs:
            print(d)
    bad = [str(d) for d in divs if d.accepted_by is None]
    assert not (strict and bad), "unexplained divergences:\n" + "\n".join(bad)
    return divs
