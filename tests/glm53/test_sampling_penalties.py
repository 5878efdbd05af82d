"""`glm53.sampling.apply_penalties` (logit bias, repetition, frequency and presence penalties on the
step's flat list of (row, id) entries) against a dense NumPy transcription of vLLM's definitions (its v1
sampler: the logit-bias processor, then `apply_penalties` of `vllm.model_executor.layers.utils`):
per-vocabulary prompt masks and output counts, no sparse lists. float32 on both sides, the same
operations per element: compared to 1e-6."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from glm53.sampling import apply_penalties, sample_with_logprobs
from tests.helpers.penalties_oracle import vllm_adjusted


def dense_vllm(logits, prompts, outputs, bias, presence, frequency, repetition):
    """vLLM's maths on [B, V] logits (tests/helpers/penalties_oracle.py, row by row): prompts /
    outputs: token lists per row; bias: {id: value} per row."""
    return np.stack([vllm_adjusted(logits[b], prompts[b], outputs[b], bias[b], presence[b], frequency[b],
                                   repetition[b]) for b in range(len(logits))])


def sparse_lists(prompts, outputs, bias, repetition, E):
    """The rows' entries as serving.penalties builds them, one flat list of (row, id, count,
    in-prompt, bias) padded to E with row −1 (ids of the prompt only when the repetition penalty
    is on); shuffled: their order must not matter."""
    entries = []
    for b in range(len(prompts)):
        c = {}
        for t in outputs[b]:
            c[t] = c.get(t, 0) + 1
        p = set(prompts[b]) if repetition[b] != 1 else set()
        entries += [(b, t, c.get(t, 0), t in p, bias[b].get(t, 0.0)) for t in sorted(set(c) | p | set(bias[b]))]
    np.random.default_rng(9).shuffle(entries)
    entries += [(-1, 0, 0, False, 0.0)] * (E - len(entries))
    row, ids, counts, in_prompt, bias_e = zip(*entries)
    return (np.asarray(row, np.int32), np.asarray(ids, np.int32), np.asarray(counts, np.int32),
            np.asarray(in_prompt, bool), np.asarray(bias_e, np.float32))


def case(seed=0, B=5, V=97):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    logits[0, 5] = -np.inf  # a masked id stays masked whatever touches it
    prompts = [rng.integers(0, V, rng.integers(1, 20)).tolist() for _ in range(B)]
    outputs = [rng.integers(0, V, rng.integers(0, 15)).tolist() for _ in range(B)]
    outputs[0] += [5, 5]
    bias = [{int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, V, rng.integers(0, 6))} for _ in range(B)]
    bias[0][5] = 50.0
    presence = np.array([0.0, 1.5, -2.0, 0.3, 0.0], np.float32)
    frequency = np.array([0.0, 0.5, 2.0, -1.0, 0.0], np.float32)
    repetition = np.array([1.0, 1.3, 0.7, 2.0, 1.0], np.float32)
    return logits, prompts, outputs, bias, presence, frequency, repetition


def test_sparse_lists_give_vllms_dense_result():
    logits, prompts, outputs, bias, presence, frequency, repetition = case()
    want = dense_vllm(logits, prompts, outputs, bias, presence, frequency, repetition)
    lists = sparse_lists(prompts, outputs, bias, repetition, E=256)
    got = np.asarray(apply_penalties(jnp.asarray(logits), *map(jnp.asarray, lists), jnp.asarray(presence),
                                     jnp.asarray(frequency), jnp.asarray(repetition)))
    assert np.isneginf(got[0, 5]) and np.isneginf(want[0, 5])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # the rows with penalties changed (the case is not vacuous)
    assert all((got[b] != logits[b]).any() for b in (1, 2, 3))


def test_the_sampler_draws_from_the_adjusted_logits_and_reports_the_raw_logprobs():
    logits, prompts, outputs, bias, presence, frequency, repetition = case(seed=1)
    B = logits.shape[0]
    lists = sparse_lists(prompts, outputs, bias, repetition, E=256)
    pen = (*map(jnp.asarray, lists), jnp.asarray(presence), jnp.asarray(frequency), jnp.asarray(repetition))
    zeros = jnp.zeros(B, jnp.float32)
    toks, tok_lp, _, _ = sample_with_logprobs(jnp.asarray(logits), zeros, jnp.ones(B), jnp.zeros(B, jnp.int32), zeros,
                                              jnp.zeros(B, jnp.uint32), jnp.zeros(B, jnp.int32), jnp.bool_(True), 2,
                                              pen)
    want = dense_vllm(logits, prompts, outputs, bias, presence, frequency, repetition)
    np.testing.assert_array_equal(np.asarray(toks), want.argmax(-1))  # greedy over the adjusted logits
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(tok_lp), raw[np.arange(B), want.argmax(-1)], rtol=1e-5, atol=1e-5)
    # a logit bias of +100 on one id at temperature 1: the draw is that id
    biased = sparse_lists([[0]] * B, [[]] * B, [{7: 100.0}] * B, np.ones(B), E=256)
    ones = jnp.ones(B, jnp.float32)
    toks, *_ = sample_with_logprobs(jnp.asarray(logits), ones, ones, jnp.zeros(B, jnp.int32), zeros,
                                    jnp.arange(B, dtype=jnp.uint32), jnp.zeros(B, jnp.int32), jnp.bool_(False), 1,
                                    (*map(jnp.asarray, biased), zeros, zeros, ones))
    assert (np.asarray(toks) == 7).all()
