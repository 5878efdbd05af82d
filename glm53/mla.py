"""Multi-head latent attention (MLA) with the DSA lightning indexer, in the absorbed form.

Sources: DeepSeek-V2/V3 MLA (q/kv LoRA, decoupled RoPE), DeepSeek-V3.2 DSA (lightning indexer),
GLM-5.x checkpoint (interleaved RoPE for MLA and indexer; indexer rope on the FIRST dims;
`k_norm` LayerNorm eps 1e-6; indexer weights scaled by I^-0.5 in fp32), HF transformers
`modeling_glm_moe_dsa.py`. Softmax scale is qk_head_dim^-0.5 (1/16), no YaRN mscale.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glm53 import attention
from glm53.batch import ForwardBatch
from glm53.config import GlmConfig
from glm53.hot_cache import HostAccess, PagedKV
from glm53.kv_layout import KVCacheLayout
from glm53.layers import LayerNorm, Linear, RMSNorm, apply_rope_interleaved
from glm53.quant import WeightQuant, scale_shape
from kernels.fp8_matmul import dequantize_fp8_blocks
from sharding.mesh import ParallelLayout


@dataclass
class LayerContext:
    """What a layer needs besides its input: the batch, the cache layout and RoPE tables."""

    batch: ForwardBatch
    layout: KVCacheLayout
    cos: jax.Array
    sin: jax.Array
    group: str = "mla"          # KV group holding this layer's latent rows
    index_group: str = "indexer"  # KV group holding this layer's indexer keys
    parallel: ParallelLayout | None = None  # the mesh and roles (None: one device)
    host: HostAccess | None = None  # HiSparse host pool (None: every selected row is resident)
    reuse_topk: bool = False  # full layers take `prev_sel` instead of running the indexer (MTP draft steps ≥ 1)

    @property
    def hisparse(self) -> bool:
        """True when full layers resolve their top-k through the HiSparse hot buffer."""
        return self.host is not None and self.batch.hot is not None


class Indexer(nnx.Module):
    """Lightning indexer of a full layer: queries from `c_q`, one shared key per token."""

    def __init__(self, cfg: GlmConfig, *, dtype, stack=(), quant: WeightQuant | None = None):
        I, Dk = cfg.index_n_heads, cfg.index_head_dim
        self.n_heads, self.head_dim, self.rope_dim = I, Dk, cfg.qk_rope_head_dim
        blk = quant.linear_block if quant is not None else None
        self.wq_b = Linear(cfg.q_lora_rank, I * Dk, dtype=dtype, stack=stack, block=blk,
                           rule="self_attn.indexer.wq_b.weight")
        self.wk = Linear(cfg.hidden_size, Dk, dtype=dtype, stack=stack, block=blk, rule="self_attn.indexer.wk.weight")
        self.k_norm = LayerNorm(Dk, 1e-6, dtype=dtype, stack=stack)
        self.weights_proj = Linear(cfg.hidden_size, I, dtype=jnp.float32, stack=stack)

    def project(self, h_TD, c_q_TQ, cos, sin, parallel=None):
        """→ (qI `[T, I, Dk]`, w `[T, I]` fp32, kI `[T, Dk]`), RoPE on the first rope_dim dims."""
        T = h_TD.shape[0]
        R = self.rope_dim
        q = self.wq_b(c_q_TQ, parallel).reshape(T, self.n_heads, self.head_dim)
        q = jnp.concatenate([apply_rope_interleaved(q[..., :R], cos, sin), q[..., R:]], axis=-1)
        k = self.k_norm(self.wk(h_TD, parallel))
        k = jnp.concatenate([apply_rope_interleaved(k[..., :R], cos, sin), k[..., R:]], axis=-1)
        w = self.weights_proj(h_TD.astype(jnp.float32)) * (self.n_heads ** -0.5)
        return q, w, k


class MLAttention(nnx.Module):
    """MLA + DSA. `kv_b_proj` is kept split as `w_uk [N, dn, A]` and `w_uv [N, A, dv]` (absorbed form).

    With `quant` (FP8 weights kept) every projection is block-scaled FP8 and `w_uk`/`w_uv` are
    FP8 codes with `w_uk_scale_inv [N, dn/g, ceil(A/b)]` / `w_uv_scale_inv [N, ceil(A/b), dv/g]`
    (glm53/quant.py: the per-head split refines the scale rows to g = gcd(b, dn, dv))."""

    def __init__(self, cfg: GlmConfig, *, has_indexer: bool, dtype, stack=(), quant: WeightQuant | None = None):
        self.cfg = cfg
        N, A, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        blk = quant.linear_block if quant is not None else None
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype, stack=stack, block=blk,
                               rule="self_attn.q_a_proj.weight")
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype, stack=stack)
        self.q_b_proj = Linear(cfg.q_lora_rank, N * cfg.qk_head_dim, dtype=dtype, stack=stack, block=blk,
                               rule="self_attn.q_b_proj.weight")
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, A + R, dtype=dtype, stack=stack, block=blk,
                                         rule="self_attn.kv_a_proj_with_mqa.weight")
        self.kv_a_layernorm = RMSNorm(A, cfg.rms_norm_eps, dtype=dtype, stack=stack)
        uk_shape, uv_shape = (*stack, N, cfg.qk_nope_head_dim, A), (*stack, N, A, cfg.v_head_dim)
        self.uk_block = quant.w_uk_block(cfg) if quant is not None else None
        self.uv_block = quant.w_uv_block(cfg) if quant is not None else None
        wdt = jnp.float8_e4m3fn if quant is not None else dtype
        self.w_uk = nnx.Param(jnp.zeros(uk_shape, wdt))
        self.w_uv = nnx.Param(jnp.zeros(uv_shape, wdt))
        self.w_uk_scale_inv = (nnx.Param(jnp.ones(scale_shape(uk_shape, self.uk_block), jnp.float32))
                               if quant is not None else None)
        self.w_uv_scale_inv = (nnx.Param(jnp.ones(scale_shape(uv_shape, self.uv_block), jnp.float32))
                               if quant is not None else None)
        self.o_proj = Linear(N * cfg.v_head_dim, cfg.hidden_size, dtype=dtype, stack=stack, block=blk,
                             rule="self_attn.o_proj.weight")
        self.indexer = Indexer(cfg, dtype=dtype, stack=stack, quant=quant) if has_indexer else None

    def absorbed_weights(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
        """`(w_uk [N, dn, A], w_uv [N, A, dv])` as real weights in `dtype` (dequantised when FP8:
        the per-head products are small batched matmuls, run by XLA over the dequantised block)."""
        if self.uk_block is None:
            return self.w_uk[...].astype(dtype), self.w_uv[...].astype(dtype)
        return (dequantize_fp8_blocks(self.w_uk[...], self.w_uk_scale_inv[...], self.uk_block, dtype=dtype),
                dequantize_fp8_blocks(self.w_uv[...], self.w_uv_scale_inv[...], self.uv_block, dtype=dtype))

    def __call__(self, h_TD, kv: PagedKV, ctx: LayerContext, mla_layer, index_layer, prev_sel, group_layers: int = 1):
        """→ (out `[T, D]`, kv, selection). The selection is `(topk [T, K] positions, slots [T, K]
        or None)`: a full layer computes it (resolving the slots through the HiSparse hot buffer
        when `ctx.hisparse`, copying missed rows for its whole IndexShare group of `group_layers`
        layers), and a shared layer reuses `prev_sel`, the one of the group's full layer. With
        `ctx.reuse_topk` a full layer reuses `prev_sel` too (its indexer does not run and writes no
        key): MTP draft steps ≥ 1 under `index_share_for_mtp_iteration`; under HiSparse a `prev_sel`
        without slots is resolved again through the layer's hot buffer (index group `index_layer`)."""
        cfg = self.cfg
        T = h_TD.shape[0]
        N, A, dn = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        par = ctx.parallel
        c_q = self.q_a_layernorm(self.q_a_proj(h_TD, par))
        q = self.q_b_proj(c_q, par).reshape(T, N, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :dn], apply_rope_interleaved(q[..., dn:], ctx.cos, ctx.sin)
        kv_lat = self.kv_a_proj_with_mqa(h_TD, par)
        c_kv = self.kv_a_layernorm(kv_lat[:, :A])
        k_pe = apply_rope_interleaved(kv_lat[:, A:], ctx.cos, ctx.sin)
        arena = attention.write_kv(kv.arena, jnp.concatenate([c_kv, k_pe], -1), ctx.batch, ctx.layout,
                                   ctx.group, "mla", mla_layer, parallel=ctx.parallel)
        if self.indexer is not None and not (ctx.reuse_topk and prev_sel is not None):
            qI, w, kI = self.indexer.project(h_TD, c_q, ctx.cos, ctx.sin, par)
            arena = attention.write_kv(arena, kI, ctx.batch, ctx.layout, ctx.index_group, "indexer",
                                       index_layer, parallel=ctx.parallel)
            topk = attention.select_topk(qI, w, arena, ctx.batch, ctx.layout, ctx.index_group, index_layer,
                                         cfg.index_topk, parallel=ctx.parallel)
            sel = (topk, None)
        else:
            sel = prev_sel
        kv = kv.with_arena(arena)
        if ctx.hisparse and self.indexer is not None and sel[1] is None:
            # A full layer's top-k (its own, or under `ctx.reuse_topk` MTP draft step 0's, which
            # its hot buffer already holds) resolved through the hot buffer.
            slots, kv = attention.resolve_hot(sel[0], kv, ctx.batch, ctx.layout, ctx.group, mla_layer, group_layers,
                                              index_layer, ctx.host, ctx.parallel)
            sel = (sel[0], slots)
        # Absorb W_UK into the queries (fp32 accumulation): q_abs = [W_UK^T q_nope | q_pe].
        w_uk, w_uv = self.absorbed_weights(q_nope.dtype)
        if q_nope.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
            # XLA:CPU has no bf16 × bf16 → f32 batched dot (DotThunk); bf16 products are exact in
            # fp32, so upcasting the operands computes the same values.
            q_nope, w_uk = q_nope.astype(jnp.float32), w_uk.astype(jnp.float32)
        q_lat = jnp.einsum("tnd,nda->tna", q_nope, w_uk, preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST)
        q_abs = jnp.concatenate([q_lat, q_pe.astype(jnp.float32)], -1)
        o_lat = attention.sparse_attention(q_abs, kv.arena, sel[0], ctx.batch, ctx.layout, ctx.group, mla_layer,
                                           kv_lora_rank=A, scale=cfg.softmax_scale, parallel=ctx.parallel,
                                           slots_TK=sel[1])
        o = jnp.einsum("tna,nav->tnv", o_lat, w_uv.astype(jnp.float32),
                       preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
        out = self.o_proj(o.reshape(T, -1).astype(h_TD.dtype), par)
        return out, kv, sel
