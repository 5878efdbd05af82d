"""Feed-forward blocks: dense SwiGLU and the DeepSeek-V3-style MoE (sigmoid router, noaux_tc).

Router (DeepSeek-V3 / GLM-5.x, HF `GlmMoeDsaTopkRouter`), in fp32: s = sigmoid(h @ W_r);
selection on s + e_score_correction_bias, group-limited (group score = sum of the top-2 biased
scores in the group; keep the best `topk_group` groups); weights s[idx] normalised
(norm_topk_prob, +1e-20) times routed_scaling_factor; plus the unweighted shared expert.
Experts run as a grouped matmul (`jax.lax.ragged_dot`) over token-sorted assignments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glm53.config import GlmConfig
from glm53.layers import Linear
from glm53.quant import WeightQuant, scale_shape
from kernels.fp8_matmul import fp8_grouped_matmul
from sharding import collectives as col
from sharding.mesh import EXPERT_COLS, EXPERTS, TOKENS


class DenseMLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, d: int, inter: int, *, dtype, stack=(), block: tuple[int, int] | None = None):
        self.gate_proj = Linear(d, inter, dtype=dtype, stack=stack, block=block, rule="mlp.gate_proj.weight")
        self.up_proj = Linear(d, inter, dtype=dtype, stack=stack, block=block, rule="mlp.up_proj.weight")
        self.down_proj = Linear(inter, d, dtype=dtype, stack=stack, block=block, rule="mlp.down_proj.weight")

    def __call__(self, x, parallel=None):
        """TP column/row splits come from the parameter shardings; `parallel` routes FP8 weights
        through the per-shard kernel (`Linear.__call__`)."""
        return self.down_proj(jax.nn.silu(self.gate_proj(x, parallel)) * self.up_proj(x, parallel), parallel)


class Router(nnx.Module):
    """weight `[D, E]` fp32, e_score_correction_bias `[E]` fp32."""

    def __init__(self, cfg: GlmConfig, *, stack=()):
        self.cfg = cfg
        self.weight = nnx.Param(jnp.zeros((*stack, cfg.hidden_size, cfg.n_routed_experts), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((*stack, cfg.n_routed_experts), jnp.float32))

    def __call__(self, x_TD):
        """→ (topk_weights `[T, k]` fp32, topk_ids `[T, k]` int32)."""
        cfg = self.cfg
        T = x_TD.shape[0]
        E, G = cfg.n_routed_experts, cfg.n_group
        logits = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), self.weight[...], precision=lax.Precision.HIGHEST)
        s = jax.nn.sigmoid(logits)
        choice = s + self.e_score_correction_bias[...]
        if G > 1:
            grouped = choice.reshape(T, G, E // G)
            group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)
            _, keep = lax.top_k(group_scores, cfg.topk_group)
            gmask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep].set(True)
            choice = jnp.where(jnp.repeat(gmask, E // G, axis=1), choice, -jnp.inf)
        _, ids = lax.top_k(choice, cfg.num_experts_per_tok)
        w = jnp.take_along_axis(s, ids, axis=-1)
        if cfg.norm_topk_prob:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return w * cfg.routed_scaling_factor, ids.astype(jnp.int32)


def routed_experts(x_TD, weights_TK, ids_TK, gate_EDI, up_EDI, down_EID, first_expert=0, scales=None, block=None):
    """Grouped-matmul SwiGLU over the experts `first_expert .. first_expert + E_local − 1` held in
    `gate/up [E_local, D, I]`, `down [E_local, I, D]`; assignments to other experts contribute 0.
    FP8 weights: `scales` = their `(gate, up, down)` `weight_scale_inv` grids and `block` the
    `(bk, bn)` block (`kernels.fp8_matmul.fp8_grouped_matmul`).

    → fp32 `[T, D]`: Σ over this shard's assignments of weight · expert(x). With every expert
    local (`first_expert = 0`, E_local = E) it is the whole routed-expert output.
    """
    T, k = ids_TK.shape
    E_local = gate_EDI.shape[0]
    flat = ids_TK.reshape(-1) - first_expert
    mine = (flat >= 0) & (flat < E_local)
    key = jnp.where(mine, flat, E_local)  # other shards' assignments sort last, outside every group
    order = jnp.argsort(key, stable=True)
    tok = order // k
    xs = x_TD[tok]
    sizes = jnp.bincount(key, length=E_local + 1)[:E_local].astype(jnp.int32)

    def gmm(a, w, s):
        if block is not None:
            return fp8_grouped_matmul(a, w, s, sizes, block=block)
        return lax.ragged_dot(a, w.astype(a.dtype), sizes, preferred_element_type=jnp.float32,
                              precision=lax.Precision.HIGHEST)

    gs, us, ds = scales if scales is not None else (None, None, None)
    h = jax.nn.silu(gmm(xs, gate_EDI, gs)) * gmm(xs, up_EDI, us)
    y = gmm(h.astype(x_TD.dtype), down_EID, ds)
    keep = mine[order][:, None]
    y = jnp.where(keep, y * weights_TK.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((T, y.shape[-1]), jnp.float32).at[tok].add(y)


class Experts(nnx.Module):
    """Routed experts stacked: gate/up `[E, D, I]`, down `[E, I, D]`.

    Under a parallel layout the experts are split by roles (sharding/rules.py): `EXPERTS` (EP:
    every device holds E / devices experts) and `EXPERT_COLS` (TP without EP: each expert's
    intermediate columns). Dispatch/combine (all-gather + reduce-scatter): the tokens of every
    shard that holds other experts are all-gathered, each device computes its experts for all of
    them, and the partial outputs are summed back — reduce-scattered to the token owners over the
    token axes, summed over the others.
    """

    def __init__(self, cfg: GlmConfig, *, dtype, stack=(), block: tuple[int, int] | None = None):
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.block = block
        wdt = jnp.float8_e4m3fn if block is not None else dtype
        self.gate_proj = nnx.Param(jnp.zeros((*stack, E, D, I), wdt))
        self.up_proj = nnx.Param(jnp.zeros((*stack, E, D, I), wdt))
        self.down_proj = nnx.Param(jnp.zeros((*stack, E, I, D), wdt))
        if block is not None:  # FP8 kept: one weight_scale_inv grid per projection (glm53/quant.py)
            self.gate_proj_scale_inv = nnx.Param(jnp.ones(scale_shape((*stack, E, D, I), block), jnp.float32))
            self.up_proj_scale_inv = nnx.Param(jnp.ones(scale_shape((*stack, E, D, I), block), jnp.float32))
            self.down_proj_scale_inv = nnx.Param(jnp.ones(scale_shape((*stack, E, I, D), block), jnp.float32))

    def __call__(self, x_TD, weights_TK, ids_TK, parallel=None):
        args = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        block = self.block
        scales = ((self.gate_proj_scale_inv[...], self.up_proj_scale_inv[...], self.down_proj_scale_inv[...])
                  if block is not None else None)
        if parallel is None or parallel.is_single_device:
            return routed_experts(x_TD, weights_TK, ids_TK, *args, scales=scales, block=block).astype(x_TD.dtype)
        par = parallel
        tok_axes = par.axes(TOKENS)
        ep_axes, col_axes = par.axes(EXPERTS), par.axes(EXPERT_COLS)
        model_axes = ep_axes + tuple(a for a in col_axes if a not in ep_axes)
        gather_axes = tuple(a for a in tok_axes if a in model_axes)
        sum_axes = tuple(a for a in model_axes if a not in gather_axes)
        E_local = self.gate_proj.shape[0] // par.size(EXPERTS)

        def body(x, w, ids, gate, up, down, sc):
            x, w, ids = (col.all_gather_tiled(a, gather_axes) for a in (x, w, ids))
            first = jax.lax.axis_index(ep_axes) * E_local if ep_axes else 0
            y = col.psum(routed_experts(x, w, ids, gate, up, down, first, scales=sc, block=block), sum_axes)
            return col.reduce_scatter_tiled(y, gather_axes)

        t2 = par.spec(TOKENS, None)
        w_specs = (par.spec(EXPERTS, None, EXPERT_COLS), par.spec(EXPERTS, None, EXPERT_COLS),
                   par.spec(EXPERTS, EXPERT_COLS, None))  # a scale grid splits like its weight
        f = jax.shard_map(body, mesh=par.mesh, check_vma=False, out_specs=t2,
                          in_specs=(t2, t2, t2, *w_specs, w_specs if scales is not None else None))
        return f(x_TD, weights_TK, ids_TK, *args, scales).astype(x_TD.dtype)


class MoE(nnx.Module):
    def __init__(self, cfg: GlmConfig, *, dtype, stack=(), quant: WeightQuant | None = None):
        blk = quant.linear_block if quant is not None else None
        self.gate = Router(cfg, stack=stack)
        self.experts = Experts(cfg, dtype=dtype, stack=stack, block=blk)
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                       dtype=dtype, stack=stack, block=blk)

    def __call__(self, x_TD, parallel=None):
        w, ids = self.gate(x_TD)
        return self.experts(x_TD, w, ids, parallel) + self.shared_experts(x_TD, parallel)
