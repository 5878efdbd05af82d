"""Decoder layers and the stacked IndexShare group.

Pre-norm residual block: `x += Attn(RMSNorm(x))`, then `x += FFN(RMSNorm(x))` (docs/design.md §3.2).
A `DecoderGroup` is one full MoE layer followed by `group_size - 1` shared MoE layers; its
parameters carry a leading stacked axis and `scan_groups` runs `lax.scan` over it so the jitted
step has few arguments and compiles once per group shape (GLM-5.3: 18 groups of 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glm53.config import GlmConfig
from glm53.layers import RMSNorm
from glm53.mla import LayerContext, MLAttention
from glm53.moe import DenseMLP, MoE


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: GlmConfig, *, has_indexer: bool, moe: bool, dtype, stack=(), quant=None):
        """`quant`: a `glm53.quant.WeightQuant` to keep the linears in block-scaled FP8, or None."""
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, stack=stack)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, stack=stack)
        self.self_attn = MLAttention(cfg, has_indexer=has_indexer, dtype=dtype, stack=stack, quant=quant)
        self.mlp = (MoE(cfg, dtype=dtype, stack=stack, quant=quant) if moe
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, stack=stack,
                                  block=quant.linear_block if quant is not None else None))

    def __call__(self, x_TD, kv, ctx: LayerContext, mla_layer, index_layer, prev_sel, group_layers: int = 1):
        """→ (x `[T, D]`, kv (`PagedKV`), selection); see `MLAttention.__call__`."""
        a, kv, sel = self.self_attn(self.input_layernorm(x_TD), kv, ctx, mla_layer, index_layer, prev_sel,
                                    group_layers)
        x_TD = x_TD + a
        x_TD = x_TD + self.mlp(self.post_attention_layernorm(x_TD), parallel=ctx.parallel)
        return x_TD, kv, sel


class DecoderGroup(nnx.Module):
    """One IndexShare group: layer 0 owns the indexer, layers 1.. reuse its top-k. Parameters are
    created with leading axes `stack` (the number of stacked groups)."""

    def __init__(self, cfg: GlmConfig, group_size: int, *, dtype, stack=(), quant=None):
        self.layers = nnx.List([
            DecoderLayer(cfg, has_indexer=(j == 0), moe=True, dtype=dtype, stack=stack, quant=quant)
            for j in range(group_size)
        ])

    def __call__(self, x_TD, kv, ctx: LayerContext, first_mla_layer, index_layer):
        sel = None
        for j, layer in enumerate(self.layers):
            x_TD, kv, sel = layer(x_TD, kv, ctx, first_mla_layer + j, index_layer, sel, len(self.layers))
        return x_TD, kv


def scan_groups(stack: DecoderGroup, x_TD, kv, ctx: LayerContext, first_mla_layer: int,
                first_index_layer: int, group_size: int):
    """Run the stacked groups in order with `lax.scan`; group g uses MLA layers
    `first_mla_layer + g * group_size + j` and indexer layer `first_index_layer + g`. `kv` (a
    `PagedKV`) is the scan carry."""
    graphdef, state = nnx.split(stack)
    num = jax.tree.leaves(state)[0].shape[0]

    def body(carry, xs):
        x, kv = carry
        g, st = xs
        group = nnx.merge(graphdef, st)
        x, kv = group(x, kv, ctx, first_mla_layer + g * group_size, first_index_layer + g)
        return (x, kv), None

    (x_TD, kv), _ = lax.scan(body, (x_TD, kv), (jnp.arange(num, dtype=jnp.int32), state))
    return x_TD, kv
