"""Verification of drafted tokens on the device: greedy prefix match and the speculative-sampling
rejection rule that keeps the target distribution.

A request verified with n drafts `d_1 … d_n` ran n + 1 target rows: row j (j = 0 … n) holds the
target's distribution for the token after `d_j` (`d_0` = the last accepted token). Row j's target
distribution `p_j` is the one ordinary sampling would use: logits / temperature, restricted by min-p,
top-k and the top-p nucleus (`serving.sampling.sample_tokens`).

* Greedy (temperature 0): `d_{j+1}` is accepted while it equals argmax(p_j); the request gets the
  accepted drafts plus argmax of the first row that was not matched (the bonus when all matched).
  The tokens are exactly those of plain greedy decoding.
* Temperature > 0 (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al. 2023): the drafter is greedy, so each draft is a one-hot proposal q = δ_d
  (as vLLM's rejection sampler treats drafts without probabilities). `d_{j+1}` is accepted with
  probability min(1, p_j(d)/q(d)) = p_j(d); at the first rejection the token is drawn from the
  residual max(0, p_j − q) normalised, which is p_j with d removed; when all n drafts are accepted
  the bonus is drawn from p_n. Then P(token) = p_j(d)·[token = d] + (1 − p_j(d))·p_j(token)/(1 − p_j(d))
  = p_j(token): every emitted token has exactly the target's distribution.

Randomness is per request and per output index, as in `serving.sampling`: row j of a request that
has generated s tokens uses `fold_in(PRNGKey(seed), s + j)` for a plain draw (the same key plain
decoding would use for that token) and derived keys for the acceptance coin and the residual draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.sampling import filter_sorted, sample_tokens, scale_logits


def _nucleus_probs(logits_V: jax.Array, t: jax.Array, p: jax.Array, top_k: jax.Array, min_p: jax.Array) -> jax.Array:
    """The sampling distribution of one row: softmax(logits / t) restricted by min-p, top-k and the
    top-p nucleus (`serving.sampling.filter_sorted`, as `sample_tokens` draws), in vocabulary
    order, fp32."""
    scaled = scale_logits(logits_V, t)
    order = jnp.argsort(-scaled)
    keep_sorted = filter_sorted(scaled[order], p, top_k, min_p)
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    probs = jnp.where(keep, jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf)), 0.0)
    return probs


def verify_drafts(logits_BSV: jax.Array, draft_BK: jax.Array, num_draft_B: jax.Array, temperature_B: jax.Array,
                  top_p_B: jax.Array, top_k_B: jax.Array, min_p_B: jax.Array, seed_B: jax.Array, step_B: jax.Array):
    """Accept or reject each request's drafts (see the module docstring).

    Args:
      logits_BSV: fp32 `[B, S, V]` target logits, S = k + 1 rows per request (row j follows draft j;
        rows past `num_draft_B` are ignored). Unreachable ids must already be −inf.
      draft_BK: int32 `[B, k]` the drafted tokens (k = S − 1 ≥ 0).
      num_draft_B: int32 `[B]` drafts actually verified per request (0 … k; 0 = plain decoding).
      temperature_B / top_p_B / top_k_B / min_p_B / seed_B (uint32) / step_B (int32, tokens generated so
        far): as in `serving.sampling.sample_tokens`.

    Returns `(tokens_BS int32, num_accepted_B int32)`: the request emits
    `tokens_BS[b, : num_accepted_B[b] + 1]` (accepted drafts, then the correction or bonus token).
    """
    B, S, V = logits_BSV.shape
    k = S - 1
    j_S = jnp.arange(S, dtype=jnp.int32)
    # Plain draws for every row: greedy rows take the argmax, sampled rows the key of output index
    # step + j (what plain decoding would draw there).
    flat = logits_BSV.reshape(B * S, V)
    rep = lambda x: jnp.repeat(x, S)  # noqa: E731
    plain_BS = sample_tokens(flat, rep(temperature_B), rep(top_p_B), rep(seed_B),
                             (step_B[:, None] + j_S[None, :]).reshape(-1), rep(top_k_B), rep(min_p_B)).reshape(B, S)
    if k == 0:
        return plain_BS, jnp.zeros((B,), jnp.int32)
    in_range_BK = j_S[None, :k] < num_draft_B[:, None]
    greedy_ok_BK = draft_BK == jnp.argmax(logits_BSV[:, :k], axis=-1).astype(jnp.int32)

    def sampled():
        def row(logits_SV, d_K, t, p, top_k, min_p, seed, step):
            probs_SV = jax.vmap(_nucleus_probs, in_axes=(0, None, None, None, None))(logits_SV, t, p, top_k, min_p)
            keys = jax.vmap(lambda j: jax.random.fold_in(jax.random.PRNGKey(seed), step + j))(j_S)
            coin = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 1)))(keys[:k])
            p_d = jnp.take_along_axis(probs_SV[:k], d_K[:, None], axis=-1)[:, 0]
            accept = coin < p_d
            resid = jnp.where(jnp.arange(V)[None, :] == d_K[:, None], 0.0, probs_SV[:k])
            resid_logits = jnp.where(resid > 0, jnp.log(jnp.maximum(resid, 1e-38)), -jnp.inf)
            recovered = jax.vmap(lambda kk, lg: jax.random.categorical(jax.random.fold_in(kk, 2), lg))(
                keys[:k], resid_logits).astype(jnp.int32)
            return accept, recovered

        acc, rec = jax.vmap(row)(logits_BSV, draft_BK, temperature_B, top_p_B, top_k_B, min_p_B,
                                 seed_B.astype(jnp.uint32), step_B)
        is_sampled = (temperature_B > 0)[:, None]
        return jnp.where(is_sampled, acc, greedy_ok_BK), jnp.where(is_sampled, rec, plain_BS[:, :k])

    ok_BK, recovered_BK = jax.lax.cond(jnp.any(temperature_B > 0), sampled,
                                       lambda: (greedy_ok_BK, plain_BS[:, :k]))
    ok_BK = ok_BK & in_range_BK
    num_accepted_B = jnp.sum(jnp.cumprod(ok_BK.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    # Row j < a: the accepted draft; row a: the residual draw if a draft was rejected there, else
    # (all n accepted) the plain draw of row n.
    a = num_accepted_B[:, None]
    rejected_at_a = a < num_draft_B[:, None]
    rec_S = jnp.concatenate([recovered_BK, plain_BS[:, k:]], axis=1)
    drafts_S = jnp.concatenate([draft_BK, plain_BS[:, k:]], axis=1)
    tokens = jnp.where(j_S[None, :] < a, drafts_S, jnp.where(rejected_at_a, rec_S, plain_BS))
    return tokens.astype(jnp.int32), num_accepted_B
