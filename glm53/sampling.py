"""On-device sampling: greedy, temperature and top-p with per-request seeds.

A request's random stream is `fold_in(PRNGKey(seed), step)` where step counts its generated
tokens, so its tokens do not depend on which other requests share the batch.

Work that no row needs is skipped inside the jitted step with `lax.cond` (both branches are
compiled once, so there is no extra compile per combination): the per-row sort of temperature
sampling runs only when some row has temperature > 0, the log-softmax and top-k of logprobs only
when the step's `want_logprobs` flag is set. At GLM-5.3's vocabulary these are the costly parts
of the sampling head (scripts/bench_logprobs_cost.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mask_unreachable(logits_BV: jax.Array, reachable: int) -> jax.Array:
    """Logits `[B, V]` with the ids `>= reachable` set to -inf (static `reachable`; a no-op when it
    is >= V).

    A checkpoint's `vocab_size` is padded past its tokenizer (GLM-5.3: 154,880 rows for 154,856
    tokens; the tiny checkpoint 512 for 496). The padding rows are never trained towards, have no
    text, and are not sampled here: greedy, temperature sampling and the reported logprobs all see
    the distribution over the tokenizer's ids (vLLM leaves them reachable and detokenizes them as
    ""; we keep them out, so a stream never holds a token without text).
    """
    V = logits_BV.shape[-1]
    if reachable >= V:
        return logits_BV
    keep = jnp.arange(V) < reachable
    return jnp.where(keep, logits_BV, jnp.asarray(-jnp.inf, logits_BV.dtype))


def apply_token_bitmask(logits_NV: jax.Array, bitmask_NW: jax.Array) -> jax.Array:
    """Logits `[..., V]` with every id whose bit is 0 in the packed bitmask set to -inf.

    bitmask_NW: int32 `[..., W]`, `W = ceil(V / 32)`, bit `i % 32` of word `i // 32` set when id
    `i` is allowed (the layout grammar engines produce: llguidance's `allocate_token_bitmask`,
    xgrammar's, vLLM's `grammar_bitmask`); a row of all ones (-1) allows everything. Ids past
    `32 * W` are not allowed. Structured outputs (`serving.structured_outputs`) pass one row per
    sampled position, so the sampled token and the reported logprobs are over the allowed ids only.
    """
    V = logits_NV.shape[-1]
    W = bitmask_NW.shape[-1]
    bits = (bitmask_NW[..., :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [..., W, 32]
    allowed = bits.reshape(*bitmask_NW.shape[:-1], W * 32)
    if W * 32 >= V:
        allowed = allowed[..., :V]
    else:
        allowed = jnp.concatenate([allowed, jnp.zeros((*allowed.shape[:-1], V - W * 32), allowed.dtype)], -1)
    return jnp.where(allowed != 0, logits_NV, jnp.asarray(-jnp.inf, logits_NV.dtype))


def sample_tokens(logits_BV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array, seed_B: jax.Array,
                  step_B: jax.Array) -> jax.Array:
    """logits fp32 `[B, V]` → token ids int32 `[B]`. temperature 0 → argmax (ties: lowest id)."""
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def one(logits, t, p, seed, step):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        scaled = logits / jnp.maximum(t, 1e-6)
        order = jnp.argsort(-scaled)
        sorted_logits = scaled[order]
        probs = jax.nn.softmax(sorted_logits)
        cum = jnp.cumsum(probs)
        keep = (cum - probs) < p  # always keeps the most likely token
        masked = jnp.where(keep, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, masked)
        return order[choice].astype(jnp.int32)

    def with_sampling():
        sampled = jax.vmap(one)(logits_BV, temperature_B, top_p_B, seed_B.astype(jnp.uint32), step_B)
        return jnp.where(temperature_B > 0, sampled, greedy)

    return jax.lax.cond(jnp.any(temperature_B > 0), with_sampling, lambda: greedy)


def compute_logprobs(logits_BV: jax.Array, token_B: jax.Array, k: int):
    """Log-probabilities of the raw model distribution (before temperature and top-p, as
    OpenAI and vLLM report them): an fp32 log-softmax over the whole vocabulary.

    Args:
      logits_BV: logits `[B, V]` (any float dtype; upcast to fp32).
      token_B: int32 `[B]`, the sampled tokens.
      k: static number of alternatives (>= 1).

    Returns:
      `(token_logprob_B fp32, top_ids_BK int32, top_logprobs_BK fp32)`: the sampled token's
      log-probability and the k most likely tokens (ties: lowest id first) with theirs.
    """
    lp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    token_lp_B = jnp.take_along_axis(lp_BV, token_B[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp_BK, top_ids_BK = jax.lax.top_k(lp_BV, k)
    return token_lp_B, top_ids_BK.astype(jnp.int32), top_lp_BK


def sample_with_logprobs(logits_BV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array, seed_B: jax.Array,
                         step_B: jax.Array, want_logprobs: jax.Array, k: int):
    """The sampling head of the step: `sample_tokens`, then `compute_logprobs` only when the
    bool scalar `want_logprobs` is set (some request of the step asked for logprobs).

    Returns `(tokens_B int32, token_logprob_B fp32, top_ids_BK int32, top_logprobs_BK fp32)`;
    the last three are zeros when `want_logprobs` is False.
    """
    tokens_B = sample_tokens(logits_BV, temperature_B, top_p_B, seed_B, step_B)
    B = logits_BV.shape[0]

    def skipped():
        return jnp.zeros((B,), jnp.float32), jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k), jnp.float32)

    lps = jax.lax.cond(want_logprobs, lambda: compute_logprobs(logits_BV, tokens_B, k), skipped)
    return (tokens_B, *lps)
