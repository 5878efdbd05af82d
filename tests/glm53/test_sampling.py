"""The sampler's filters (`glm53.sampling`): min-p, top-k and top-p in vLLM's order.

Independent oracle: a float64 numpy implementation of the same rule written from vLLM's
description (temperature, then min-p over the whole distribution, then top-k by rank, then the
top-p nucleus renormalised over what those kept). Rows where a float64 threshold falls within
1e-5 of a kept / dropped boundary are left out of the exact comparison (float32 rounding may
decide them either way on another XLA build).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm53.sampling import filter_sorted, sample_tokens

V = 40


def reference_keep(logits, t, top_p, top_k, min_p):
    """(kept ids as a bool [V] in vocabulary order, ambiguous row?) in float64."""
    x = logits.astype(np.float64) / t
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    others = np.arange(V) != np.argmax(p)  # the most likely token is kept whatever min_p
    margin = np.abs(p[others] - min_p * p.max()).min() if min_p > 0 else 1.0
    order = np.argsort(-x, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    before = np.cumsum(q[order]) - q[order]  # mass of the more likely kept tokens
    nucleus = np.zeros(V, bool)
    nucleus[order] = before < top_p
    live = keep[order]
    if top_p < 1:
        margin = min(margin, np.abs(before[live] - top_p).min())
    return keep & nucleus, margin < 1e-5


def test_each_filter_keeps_what_the_reference_keeps():
    rng = np.random.default_rng(0)
    rows = checked = 0
    keep_fn = jax.jit(jax.vmap(filter_sorted))
    for _ in range(6):
        B = 64
        logits = (rng.normal(size=(B, V)) * rng.uniform(0.5, 4.0, size=(B, 1))).astype(np.float32)
        t = rng.uniform(0.3, 1.5, B).astype(np.float32)
        top_p = rng.choice([1.0, 0.9, 0.6, 0.3], B).astype(np.float32)
        top_k = rng.choice([0, -1, 1, 3, 10, 100], B).astype(np.int32)
        min_p = rng.choice([0.0, 0.05, 0.2, 0.7, 1.0], B).astype(np.float32)
        scaled = logits / t[:, None]
        order = np.argsort(-scaled, axis=-1, kind="stable")
        keep_sorted = np.asarray(keep_fn(jnp.take_along_axis(jnp.asarray(scaled), jnp.asarray(order), -1),
                                         top_p, top_k, min_p))
        for b in range(B):
            rows += 1
            ref, ambiguous = reference_keep(logits[b], t[b], top_p[b], top_k[b], min_p[b])
            if ambiguous:
                continue
            got = np.zeros(V, bool)
            got[order[b]] = keep_sorted[b]
            np.testing.assert_array_equal(got, ref, err_msg=f"row {b}: p={top_p[b]} k={top_k[b]} m={min_p[b]}")
            assert got[np.argmax(logits[b])]  # the most likely token is always kept
            checked += 1
    assert checked > 0.9 * rows


def test_filters_off_draw_exactly_the_plain_top_p_tokens():
    """top_k 0 / -1 and min_p 0 are the sampler without those filters, draw for draw."""
    rng = np.random.default_rng(1)
    B = 32
    logits = jnp.asarray(rng.normal(size=(B, V)) * 2, jnp.float32)
    t = jnp.asarray(rng.uniform(0.5, 1.5, B), jnp.float32)
    p = jnp.asarray(rng.choice([1.0, 0.8], B), jnp.float32)
    seeds = jnp.arange(B, dtype=jnp.uint32)
    plain = jax.jit(sample_tokens)
    filtered = jax.jit(sample_tokens)
    for step in range(8):
        s = jnp.full(B, step, jnp.int32)
        want = np.asarray(plain(logits, t, p, seeds, s))
        for k in (0, -1):
            got = filtered(logits, t, p, seeds, s, jnp.full(B, k, jnp.int32), jnp.zeros(B, jnp.float32))
            np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("top_p,top_k,min_p", [(1.0, 3, 0.0), (0.8, 0, 0.1), (0.9, 5, 0.05)])
def test_draws_follow_the_filtered_distribution(top_p, top_k, min_p):
    """One row drawn N times (a seed per draw): no token outside the kept set, and Pearson's
    chi-square against the reference distribution (fails below p = 1e-4; a filter applied in
    another order, or not at all, is far below that at this N)."""
    rng = np.random.default_rng(2)
    N, t = 20_000, 0.9
    row = (rng.normal(size=V) * 2).astype(np.float32)
    keep, ambiguous = reference_keep(row, t, top_p, top_k, min_p)
    assert not ambiguous
    x = row.astype(np.float64) / t
    prob = np.where(keep, np.exp(x - x.max()), 0.0)
    prob /= prob.sum()
    toks = jax.jit(sample_tokens)(jnp.broadcast_to(jnp.asarray(row), (N, V)), jnp.full(N, t, jnp.float32),
                                  jnp.full(N, top_p, jnp.float32), jnp.arange(N, dtype=jnp.uint32),
                                  jnp.zeros(N, jnp.int32), jnp.full(N, top_k, jnp.int32),
                                  jnp.full(N, min_p, jnp.float32))
    counts = np.bincount(np.asarray(toks), minlength=V)
    assert counts[~keep].sum() == 0
    assert 1 < keep.sum() < V  # the filters kept some tokens and dropped others
    expected = prob[keep] * N
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    pvalue = float(jax.scipy.special.gammaincc((keep.sum() - 1) / 2, stat / 2))
    assert pvalue > 1e-4, (pvalue, counts[keep], expected)


def test_greedy_rows_ignore_the_filters():
    rng = np.random.default_rng(3)
    B = 8
    logits = jnp.asarray(rng.normal(size=(B, V)), jnp.float32)
    toks = jax.jit(sample_tokens)(logits, jnp.zeros(B), jnp.full(B, 0.5), jnp.arange(B, dtype=jnp.uint32),
                                  jnp.zeros(B, jnp.int32), jnp.full(B, 1, jnp.int32), jnp.full(B, 0.9))
    np.testing.assert_array_equal(np.asarray(toks), np.argmax(np.asarray(logits), -1))
    assert math.isfinite(float(jnp.max(logits)))


def test_a_huge_temperature_draws_uniformly_over_the_reachable_ids():
    """1e38 (near float32's largest) and 1e39 (a finite request value that is inf in float32) used
    to give NaN logits and always one id: now every reachable id is drawn, none of the unreachable
    (−inf) ones."""
    B, n = 4000, 10
    logits = np.random.default_rng(4).normal(size=V).astype(np.float32) * 5
    logits[n:] = -np.inf
    for t in (np.float32(1e38), np.float32(np.inf)):
        toks = np.asarray(jax.jit(sample_tokens)(jnp.broadcast_to(jnp.asarray(logits), (B, V)),
                                                 jnp.full(B, t, jnp.float32), jnp.ones(B), jnp.arange(B, dtype=jnp.uint32),
                                                 jnp.zeros(B, jnp.int32)))
        counts = np.bincount(toks, minlength=V)
        assert counts[n:].sum() == 0 and (counts[:n] > B / n / 2).all(), (t, counts)
