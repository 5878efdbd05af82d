"""GLM-5.x (`GlmMoeDsaForCausalLM`) as Flax NNX modules over paged-cache reference kernels.

Architecture choices and their sources:
* MLA with q LoRA 2048 / kv LoRA 512, qk 192 nope + 64 rope, v 256, run in the absorbed form
  (DeepSeek-V2/V3; GLM-5.x checkpoint). Softmax scale qk_head_dim^-0.5, no YaRN.
* Interleaved RoPE, theta 8e6 for GLM-5.3 (config), on the MLA rope part and on the FIRST 64 dims
  of the indexer q/k (HF transformers `glm_moe_dsa`).
* DSA lightning indexer (DeepSeek-V3.2) with IndexShare: shared layers reuse the nearest preceding
  full layer's top-k (GLM-5.3 config `index_topk_freq`/`index_skip_topk_offset`).
* Dense SwiGLU for the first `first_k_dense_replace` layers, then DeepSeek-V3 MoE with sigmoid
  router, correction bias, group-limited top-k, routed scaling 2.5, one shared expert.
* One MTP layer (DeepSeek-V3 MTP): `eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])`, a full MoE+DSA
  block, `shared_head.norm`, the backbone's `lm_head`.
* The KV cache is one paged arena threaded through the forward pass (glm53/kv_layout.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm53.batch import ForwardBatch
from glm53.config import GlmConfig
from glm53.decoder import DecoderGroup, DecoderLayer, scan_groups
from glm53.hot_cache import HostAccess, PagedKV
from glm53.kv_layout import KVCacheLayout
from glm53.layers import Linear, RMSNorm, mm, rope_cos_sin
from glm53.mla import LayerContext
from glm53.quant import WeightQuant
from sharding.mesh import TOKENS, ParallelLayout, constrain


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype):
        self.weight = nnx.Param(jnp.zeros((vocab, dim), dtype))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


class MTPLayer(nnx.Module):
    """Multi-token-prediction layer `model.layers.{num_hidden_layers}` (predicts token i+2)."""

    def __init__(self, cfg: GlmConfig, *, dtype, quant: WeightQuant | None = None):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * D, D, dtype=dtype)
        self.block = DecoderLayer(cfg, has_indexer=True, moe=True, dtype=dtype, quant=quant)
        self.shared_head_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)


class GlmForCausalLM(nnx.Module):
    """The backbone, head and MTP layer. Parameters start at zeros/ones; load real weights with
    `glm53.loader.load_weights` (or build with `glm53.api.load`).

    `dtype`: activations and unquantised weights. `quant`: a `glm53.quant.WeightQuant` keeps every
    linear of attention and FFN in block-scaled FP8 (weights float8_e4m3fn + fp32
    `weight_scale_inv`); embeddings, head, norms, router and `eh_proj` stay in `dtype`."""

    def __init__(self, cfg: GlmConfig, *, dtype=jnp.float32, quant: WeightQuant | None = None):
        self.cfg = cfg
        self.quant = quant
        plan = cfg.layer_plan
        self.plan = plan
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nnx.List([
            DecoderLayer(cfg, has_indexer=cfg.indexer_types[i] == "full", moe=cfg.mlp_layer_types[i] == "sparse",
                         dtype=dtype, quant=quant)
            for i in plan.head
        ])
        self.stack = (DecoderGroup(cfg, plan.group_size, dtype=dtype, stack=(plan.num_stacked_groups,), quant=quant)
                      if plan.num_stacked_groups else None)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        self.mtp = MTPLayer(cfg, dtype=dtype, quant=quant) if cfg.num_mtp_layers > 0 else None

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def hidden_states(self, batch: ForwardBatch, kv_arena, layout: KVCacheLayout,
                      parallel: ParallelLayout | None = None, host: HostAccess | None = None):
        """Backbone forward → (final-normed hidden `[T, D]`, updated cache).

        kv_arena: the arena `uint32[num_blocks, page_words]`, or a `PagedKV` (arena + HiSparse hot
        state); the updated cache is returned in the same form.
        `parallel`: the mesh and roles when the parameters, batch and arena are sharded
        (sharding/rules.py); None on one device.
        `host`: HiSparse host-pool access; with it (and `batch.hot`, `kv_arena.hot`) each
        IndexShare group's full layer resolves its top-k through the hot buffer
        (`glm53.attention.resolve_hot`)."""
        cfg = self.cfg
        wrapped = isinstance(kv_arena, PagedKV)
        kv = kv_arena if wrapped else PagedKV(kv_arena)
        batch = jax.tree.map(jnp.asarray, batch)
        cos, sin = rope_cos_sin(batch.positions_T, cfg.qk_rope_head_dim, cfg.rope_theta)
        if host is not None and (batch.hot is None or kv.hot is None):
            raise ValueError("HiSparse host access needs batch.hot and a PagedKV with hot state")
        ctx = LayerContext(batch=batch, layout=layout, cos=cos, sin=sin, parallel=parallel, host=host)
        full = cfg.full_layers
        x = constrain(self.embed_tokens(batch.input_ids_T), parallel, TOKENS, None)
        sel = None
        for i, layer in zip(self.plan.head, self.layers):
            idx_layer = full.index(i) if cfg.indexer_types[i] == "full" else 0
            x, kv, sel = layer(x, kv, ctx, i, idx_layer, sel, cfg.index_group_size(i))
        if self.stack is not None:
            x, kv = scan_groups(self.stack, x, kv, ctx, self.plan.stack_start,
                                full.index(self.plan.stack_start), self.plan.group_size)
        return self.norm(x), (kv if wrapped else kv.arena)

    def logits(self, h_TD):
        """`lm_head` in fp32 → `[T, vocab]`."""
        return mm(h_TD, self.lm_head.weight[...]).astype(jnp.float32)

    def __call__(self, batch: ForwardBatch, kv_arena, layout: KVCacheLayout,
                 parallel: ParallelLayout | None = None, host: HostAccess | None = None):
        """→ (logits fp32 `[len(logits_indices), vocab]`, hidden `[T, D]`, cache); the cache
        arguments as in `hidden_states`."""
        h, kv_arena = self.hidden_states(batch, kv_arena, layout, parallel, host)
        return self.logits(h[jnp.asarray(batch.logits_indices_B)]), h, kv_arena

    def mtp_logits(self, batch: ForwardBatch, hidden_TD: jax.Array, kv_arena: jax.Array, layout: KVCacheLayout,
                   parallel: ParallelLayout | None = None, zero_embed_pos0: bool = True):
        """MTP step: `batch.input_ids_T[i]` is token i+1 paired with backbone hidden `hidden_TD[i]`
        (final-normed) at position `batch.positions_T[i]` = i; uses the `mtp` KV group.
        → (logits fp32 `[len(logits_indices), vocab]` predicting token i+2, kv_arena).
        `zero_embed_pos0`: zero the embedding at position 0 (vLLM's form, docs/design.md §3.6); see
        `glm53.mtp.mtp_forward`. Raises ValueError when the model has no MTP layer."""
        from glm53.mtp import mtp_forward

        batch = jax.tree.map(jnp.asarray, batch)
        h, kv_arena, _ = mtp_forward(self, batch, hidden_TD, kv_arena, layout, parallel,
                                     zero_embed_pos0=zero_embed_pos0)
        return self.logits(h[batch.logits_indices_B]), kv_arena
