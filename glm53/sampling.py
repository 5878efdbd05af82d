"""On-device sampling: greedy, temperature, min-p, top-k and top-p with per-request seeds.

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


def apply_penalties(logits_NV: jax.Array, row_E: jax.Array, ids_E: jax.Array, counts_E: jax.Array,
                    in_prompt_E: jax.Array, bias_E: jax.Array, presence_N: jax.Array, frequency_N: jax.Array,
                    repetition_N: jax.Array) -> jax.Array:
    """Logit bias and the repetition, frequency and presence penalties on fp32 logits `[N, V]`
    → the adjusted logits `[N, V]` (the sampler's input; logprobs stay those of the raw logits).

    The step's entries, one per (row, id) a row touches (`serving.penalties` builds them; the pairs
    are distinct): row_E int32 `[E]` (−1: padding; rows at or past N are dropped too), ids_E int32
    `[E]`, counts_E int32 `[E]` (how often the id is in the row's output so far), in_prompt_E bool
    `[E]` (the id is in its prompt), bias_E fp32 `[E]` (`logit_bias`, 0 when none); presence_N,
    frequency_N, repetition_N fp32 `[N]` (0, 0, 1: off). The maths and order are vLLM's (its v1
    sampler: the logit-bias processor, then `apply_penalties` of `vllm.model_executor.layers.utils`,
    which follows OpenAI's definition of the last two): for a listed id with logit x, x += bias;
    where the id is in the prompt or the output, x /= repetition if x > 0 else x *= repetition; then
    x −= frequency · count + presence · (count > 0). Ids not listed keep their logits; −inf (a
    masked id) stays −inf.
    """
    N = logits_NV.shape[0]
    valid = (row_E >= 0) & (row_E < N)
    r = jnp.where(valid, row_E, 0)
    i = jnp.where(valid, ids_E, 0)
    x = logits_NV[r, i] + bias_E
    seen = in_prompt_E | (counts_E > 0)
    rep = repetition_N[r]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - frequency_N[r] * counts_E.astype(x.dtype) - presence_N[r] * (counts_E > 0).astype(x.dtype)
    return logits_NV.at[jnp.where(valid, r, N), i].set(x, mode="drop")


# Temperatures are clipped to [MIN, MAX] in the division: XLA may divide by multiplying with the
# reciprocal, and 1 / t for t near float32's largest value is subnormal, flushed to 0, and then
# -inf (an unreachable id's logit) × 0 is NaN. Past MAX every finite logit scales to about 0: the
# draw is uniform over the allowed ids, which is what such a temperature asks for.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e30


def scale_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """logits / temperature (fp32), the temperature clipped to [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    return logits / jnp.clip(temperature, MIN_TEMPERATURE, MAX_TEMPERATURE)


def filter_sorted(sorted_logits_V: jax.Array, top_p: jax.Array, top_k: jax.Array | None = None,
                  min_p: jax.Array | None = None) -> jax.Array:
    """Which tokens one row samples from, in descending-logit order → bool `[V]`.

    sorted_logits_V: fp32 `[V]`, the row's temperature-scaled logits sorted in descending order
    (ties: lower id first). top_p: nucleus mass in (0, 1]. top_k: int, the k most likely tokens;
    0 or -1 keeps all. min_p: in [0, 1], drop tokens less likely than min_p × the most likely
    token's probability; 0 keeps all. None skips a filter.

    vLLM's order (its v1 sampler: temperature, then min-p, then top-k, then top-p on what top-k
    left): min-p over the whole distribution, top-k by rank, then the smallest prefix whose mass,
    renormalised over what the first two kept, reaches top_p. The most likely token is always kept.
    With top_k in {0, -1} and min_p 0 this is exactly the plain top-p nucleus (bit for bit)."""
    keep = None
    if min_p is not None:
        probs = jax.nn.softmax(sorted_logits_V)
        keep = probs >= min_p * probs[0]
    if top_k is not None:
        by_rank = (top_k <= 0) | (jnp.arange(sorted_logits_V.shape[-1]) < top_k)
        keep = by_rank if keep is None else keep & by_rank
    kept = sorted_logits_V if keep is None else jnp.where(keep, sorted_logits_V, -jnp.inf)
    probs = jax.nn.softmax(kept)
    # Always keeps the most likely token; top_p 1 keeps every token (the float32 sum of the more
    # likely tokens' mass can round up to 1 before the least likely ones).
    nucleus = ((jnp.cumsum(probs) - probs) < top_p) | (top_p >= 1.0)
    return nucleus if keep is None else keep & nucleus


def sample_tokens(logits_BV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array, seed_B: jax.Array,
                  step_B: jax.Array, top_k_B: jax.Array | None = None, min_p_B: jax.Array | None = None) -> jax.Array:
    """logits fp32 `[B, V]` → token ids int32 `[B]`. temperature 0 → argmax (ties: lowest id);
    otherwise a draw from softmax(logits / temperature) restricted by `filter_sorted` (top_p_B
    float32, top_k_B int32, min_p_B float32, all `[B]`; None: that filter off for every row)."""
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    B = logits_BV.shape[0]
    filters = (top_k_B is not None, min_p_B is not None)  # static: a filter no caller uses is not traced
    top_k_B = jnp.zeros((B,), jnp.int32) if top_k_B is None else top_k_B
    min_p_B = jnp.zeros((B,), jnp.float32) if min_p_B is None else min_p_B

    def one(logits, t, p, k, m, seed, step):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        scaled = scale_logits(logits, t)
        order = jnp.argsort(-scaled)
        sorted_logits = scaled[order]
        keep = filter_sorted(sorted_logits, p, k if filters[0] else None, m if filters[1] else None)
        masked = jnp.where(keep, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, masked)
        return order[choice].astype(jnp.int32)

    def with_sampling():
        sampled = jax.vmap(one)(logits_BV, temperature_B, top_p_B, top_k_B, min_p_B, seed_B.astype(jnp.uint32),
                                step_B)
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
    return _token_and_top_logprobs(jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1), token_B, k)


def _token_and_top_logprobs(lp_BV: jax.Array, token_B: jax.Array, k: int):
    """From log-probabilities `[B, V]`: (each row's `token_B` logprob, the top k ids, their logprobs)."""
    token_lp_B = jnp.take_along_axis(lp_BV, token_B[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp_BK, top_ids_BK = jax.lax.top_k(lp_BV, k)
    return token_lp_B, top_ids_BK.astype(jnp.int32), top_lp_BK


def prompt_token_logprobs(logits_PV: jax.Array, target_P: jax.Array, k: int):
    """Prompt logprobs of one block of prompt positions (vLLM's `prompt_logprobs`): each row's
    logits predict the next prompt token `target_P`; the distribution is the raw one (fp32
    log-softmax, as `compute_logprobs`).

    Args:
      logits_PV: logits `[P, V]` (any float dtype; upcast to fp32).
      target_P: int32 `[P]`, the prompt token that follows each row's position.
      k: static number of alternatives (>= 1).

    Returns:
      `(target_logprob_P fp32, rank_P int32, top_ids_PK int32, top_logprobs_PK fp32)`; the rank is
      the number of ids at least as likely as the target (vLLM's definition: 1 for the most
      likely, ties counted against the target).
    """
    lp_PV = jax.nn.log_softmax(logits_PV.astype(jnp.float32), axis=-1)
    target_lp_P, top_ids_PK, top_lp_PK = _token_and_top_logprobs(lp_PV, target_P, k)
    rank_P = jnp.sum(lp_PV >= target_lp_P[:, None], axis=-1, dtype=jnp.int32)
    return target_lp_P, rank_P, top_ids_PK, top_lp_PK


def sample_with_logprobs(logits_BV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array, top_k_B: jax.Array,
                         min_p_B: jax.Array, seed_B: jax.Array, step_B: jax.Array, want_logprobs: jax.Array, k: int,
                         penalties: tuple | None = None):
    """The sampling head of the step: `sample_tokens` (top_k_B int32 `[B]`, min_p_B float32 `[B]`
    as there), then `compute_logprobs` only when the bool scalar `want_logprobs` is set (some
    request of the step asked for logprobs). penalties: None, or the arguments of
    `apply_penalties` after the logits: the tokens are drawn from the adjusted logits, the
    logprobs are those of `logits_BV` (vLLM's default, raw logprobs).

    Returns `(tokens_B int32, token_logprob_B fp32, top_ids_BK int32, top_logprobs_BK fp32)`;
    the last three are zeros when `want_logprobs` is False.
    """
    sampling_BV = logits_BV if penalties is None else apply_penalties(logits_BV.astype(jnp.float32), *penalties)
    tokens_B = sample_tokens(sampling_BV, temperature_B, top_p_B, seed_B, step_B, top_k_B, min_p_B)
    B = logits_BV.shape[0]

    def skipped():
        return jnp.zeros((B,), jnp.float32), jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k), jnp.float32)

    lps = jax.lax.cond(want_logprobs, lambda: compute_logprobs(logits_BV, tokens_B, k), skipped)
    return (tokens_B, *lps)
