"""Training-mode forward of `GlmForCausalLM`: whole sequences, no cache, dense or DSA-sparse attention.

The serving forward (`GlmForCausalLM.__call__`) reads and writes the paged arena one step at a
time; training needs every position of a batch of sequences at once and gradients. This module
runs the SAME parameters (the NNX modules' own projections, norms, indexer, router and experts)
over `[B, T]` token batches:

* MLA in the non-absorbed form (DeepSeek-V2 training form): `k_nope = c_kv W_UK^T`,
  `v = c_kv W_UV`, scores `(q_nope·k_nope + q_pe·k_pe) · qk_head_dim^-0.5`. The absorbed form the
  serving kernels use is the same product reassociated.
* DSA (DeepSeek-V3.2 §2.1): the lightning indexer score
  `I[t, s] = Σ_j w[t, j] · ReLU(qI[t, j]·kI[s]) · Dk^-0.5` (the formula of
  `kernels/indexer_topk/reference.py`); sparse attention keeps, per query, the `index_topk`
  causal positions with the highest `I` (ties: lower position, as `lax.top_k` and the serving
  kernel do); the shared layers of an IndexShare group reuse the selection of the group's full
  layer (GLM-5.3).
* Indexer training (DeepSeek-V3.2 §2.1.1): the indexer's inputs are detached (`stop_gradient`), so
  its only gradient is the KL loss `KL(p_t ‖ softmax(I_t))`, where `p_t` is the main attention
  summed over the heads — here over the heads of every layer of the IndexShare group the indexer
  serves — and L1-normalised (a constant: `stop_gradient`). Dense mode: over all causal positions
  (the warm-up); sparse mode: over the selected set `S_t` only. The language-model loss cannot
  reach the indexer (the top-k mask has no gradient).
* MTP (DeepSeek-V3 §2.2): position i pairs `embed(t_{i+1})` (zero at position 0, as the serving
  drafter does) with the backbone's final-normed hidden state `h_i`; `eh_proj`, the MTP decoder
  block (its own indexer and KV), `shared_head.norm` and the shared `lm_head` predict `t_{i+2}`.
  `h_i` is detached here (the MTP loss trains the MTP layer, the shared embedding and head, not
  the backbone's hidden states).

Everything is fp32 on the caller's arrays; memory is O(B · heads · T²) per layer (meant for the
tiny models of `scripts/train_tiny.py`, T ≤ a few thousand).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glm53.layers import apply_rope_interleaved, rope_cos_sin


@dataclass
class TrainOutputs:
    """What `train_forward` returns.

    logits_BTV: fp32 `[B, T, V]`, position t predicts token t+1.
    mtp_logits_BTV: fp32 `[B, T, V]`, position t predicts token t+2 (None without an MTP layer).
    indexer_kl: fp32 scalar, the mean over (sequence, query, indexer) of the DSA KL loss.
    topk_mass: fp32 scalar, the mean over queries and indexers of the share of the group's
      summed attention mass that lies on the indexer's top-k positions (dense mode: how much of
      the dense attention a sparse forward would keep; sparse mode: 1 by construction).
    """

    logits_BTV: jax.Array
    mtp_logits_BTV: jax.Array | None
    indexer_kl: jax.Array
    topk_mass: jax.Array


def decoder_layers(model) -> list[tuple[int, object]]:
    """`[(layer index, DecoderLayer)]` in order; the stacked IndexShare groups are sliced out of
    the stacked parameters (inside a traced function the slices are traced views, so gradients
    reach the stacked arrays)."""
    plan = model.plan
    out = list(zip(plan.head, model.layers))
    if model.stack is not None:
        graphdef, state = nnx.split(model.stack)
        for g in range(plan.num_stacked_groups):
            group = nnx.merge(graphdef, jax.tree.map(lambda x, g=g: x[g], state))
            out.extend((plan.stacked_layer(g, j), layer) for j, layer in enumerate(group.layers))
    return out


def _rope_bt(x, cos, sin):
    """Interleaved RoPE on `x [B, T, ..., R]` (tables `[T, R/2]`)."""
    return jnp.moveaxis(apply_rope_interleaved(jnp.moveaxis(x, 1, 0), cos, sin), 0, 1)


def indexer_scores(indexer, h_BTD, c_q_BTQ, cos, sin) -> jax.Array:
    """Lightning-indexer scores `I [B, T, S=T]` fp32 (no mask), inputs detached."""
    h, c_q = lax.stop_gradient(h_BTD), lax.stop_gradient(c_q_BTQ)
    q, w, k = jax.vmap(lambda a, b: indexer.project(a, b, cos, sin))(h, c_q)
    dots = jnp.einsum("btid,bsd->btis", q.astype(jnp.float32), k.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)
    score = jnp.einsum("bti,btis->bts", w, jnp.maximum(dots, 0.0), precision=lax.Precision.HIGHEST) * (
        indexer.head_dim ** -0.5)
    return jnp.where(score == 0, 0.0, score)  # −0.0 ties with +0.0 (the serving kernel's rule)


def topk_mask(scores_BTS: jax.Array, causal_TS: jax.Array, k: int) -> jax.Array:
    """bool `[B, T, S]`: each query's `k` highest-scoring causal positions (all of them when
    fewer than k are visible)."""
    B, T, S = scores_BTS.shape
    if k >= S:
        return jnp.broadcast_to(causal_TS, (B, T, S))
    masked = jnp.where(causal_TS, scores_BTS, -jnp.inf)
    _, idx = lax.top_k(masked, k)
    sel = jnp.zeros((B, T, S), bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], idx].set(True)
    return sel & causal_TS


def _kl(target_BTS, scores_BTS, allowed_BTS):
    """Mean over queries of KL(target ‖ softmax(scores)) restricted to `allowed` (target given as
    unnormalised non-negative mass)."""
    p = target_BTS / jnp.maximum(jnp.sum(target_BTS, -1, keepdims=True), 1e-30)
    logq = jax.nn.log_softmax(jnp.where(allowed_BTS, scores_BTS, -jnp.inf), axis=-1)
    terms = jnp.where(allowed_BTS & (p > 0), p * (jnp.log(jnp.maximum(p, 1e-30)) - logq), 0.0)
    return jnp.mean(jnp.sum(terms, -1))


def attention_train(attn, h_BTD, cos, sin, mask_BTS, c_q=None):
    """MLA over whole sequences in the non-absorbed form → (out `[B, T, D]`, probs summed over
    heads `[B, T, S]` fp32). `c_q`: the query LoRA latent when the caller already has it."""
    cfg = attn.cfg
    B, T, _ = h_BTD.shape
    N, A, dn = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    if c_q is None:
        c_q = attn.q_a_layernorm(attn.q_a_proj(h_BTD))
    q = attn.q_b_proj(c_q).reshape(B, T, N, cfg.qk_head_dim)
    q_nope, q_pe = q[..., :dn], _rope_bt(q[..., dn:], cos, sin)
    kv_lat = attn.kv_a_proj_with_mqa(h_BTD)
    c_kv = attn.kv_a_layernorm(kv_lat[..., :A])
    k_pe = _rope_bt(kv_lat[..., A:], cos, sin)
    hi = lax.Precision.HIGHEST
    k_nope = jnp.einsum("bsa,nda->bsnd", c_kv, attn.w_uk[...], precision=hi)
    v = jnp.einsum("bsa,nav->bsnv", c_kv, attn.w_uv[...], precision=hi)
    s = (jnp.einsum("btnd,bsnd->bnts", q_nope, k_nope, precision=hi)
         + jnp.einsum("btnr,bsr->bnts", q_pe, k_pe, precision=hi)) * cfg.softmax_scale
    s = jnp.where(mask_BTS[:, None], s.astype(jnp.float32), -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bnts,bsnv->btnv", p, v.astype(jnp.float32), precision=hi).reshape(B, T, -1)
    return attn.o_proj(o.astype(h_BTD.dtype)), jnp.sum(p, axis=1)


def _run_layers(layers, x_BTD, cos, sin, *, sparse: bool, topk: int, index_types):
    """Run decoder layers; → (x, summed KL over indexers, number of indexers, mean top-k mass)."""
    B, T, D = x_BTD.shape
    causal = jnp.tril(jnp.ones((T, T), bool))
    kl_sum, n_idx, mass_sum = jnp.float32(0), 0, jnp.float32(0)
    group = None  # (scores, allowed, target mass accumulated)

    def close(group):
        scores, allowed, selected, target = group
        target = lax.stop_gradient(target)
        kl = _kl(target, scores, allowed)
        kept = jnp.where(selected, target, 0.0).sum(-1)
        mass = jnp.mean(kept / jnp.maximum(target.sum(-1), 1e-30))
        return kl, mass

    for i, layer in layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x_BTD)
        c_q = None
        if index_types[i] == "full":
            if group is not None:
                kl, mass = close(group)
                kl_sum, mass_sum, n_idx = kl_sum + kl, mass_sum + mass, n_idx + 1
            c_q = attn.q_a_layernorm(attn.q_a_proj(h))
            scores = indexer_scores(attn.indexer, h, c_q, cos, sin)
            selected = topk_mask(lax.stop_gradient(scores), causal, topk)  # computed once: mask and metric
            mask = selected if sparse else jnp.broadcast_to(causal, (B, T, T))
            group = [scores, mask, selected, jnp.zeros((B, T, T), jnp.float32)]
        a, probs = attention_train(attn, h, cos, sin, group[1], c_q)
        group[3] = group[3] + probs
        x_BTD = x_BTD + a
        y = layer.mlp(layer.post_attention_layernorm(x_BTD).reshape(B * T, D))
        x_BTD = x_BTD + y.reshape(B, T, D)
    kl, mass = close(group)
    return x_BTD, kl_sum + kl, n_idx + 1, (mass_sum + mass) / (n_idx + 1)


def train_forward(model, input_ids_BT: jax.Array, *, sparse: bool, mtp: bool = True) -> TrainOutputs:
    """Training forward over `input_ids_BT` int32 `[B, T]` (positions 0..T−1 in every row).

    `sparse`: DSA top-k attention (`index_topk` per query, IndexShare groups sharing the full
    layer's selection); otherwise dense causal attention (the warm-up). `mtp`: also run the MTP
    layer (needs one). The maths and sources are in the module docstring.
    """
    if model.quant is not None:
        raise ValueError("train_forward needs a model with unquantised weights (load with quantization='none')")
    cfg = model.cfg
    B, T = input_ids_BT.shape
    cos, sin = rope_cos_sin(jnp.arange(T, dtype=jnp.int32), cfg.qk_rope_head_dim, cfg.rope_theta)
    x = model.embed_tokens(input_ids_BT)
    x, kl, n, mass = _run_layers(decoder_layers(model), x, cos, sin, sparse=sparse, topk=cfg.index_topk,
                                 index_types=cfg.indexer_types)
    h = model.norm(x)
    logits = model.logits(h)
    mtp_logits = None
    if mtp:
        if model.mtp is None:
            raise ValueError("train_forward(mtp=True): the model has no MTP layer")
        m = model.mtp
        nxt = jnp.concatenate([input_ids_BT[:, 1:], input_ids_BT[:, -1:]], axis=1)
        emb = model.embed_tokens(nxt)
        emb = emb.at[:, 0].set(0.0)
        u = m.eh_proj(jnp.concatenate([m.enorm(emb), m.hnorm(lax.stop_gradient(h))], axis=-1))
        y, kl_m, _, _ = _run_layers([(0, m.block)], u, cos, sin, sparse=sparse, topk=cfg.index_topk,
                                    index_types=("full",))
        mtp_logits = model.logits(m.shared_head_norm(y))
        kl, n = kl + kl_m, n + 1
    return TrainOutputs(logits, mtp_logits, kl / n, mass)
