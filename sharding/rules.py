"""Partition rules: every parameter of `GlmForCausalLM` and the KV arena → a sharding by roles.

Rules match the dotted parameter path of the NNX state (`layers.3.self_attn.q_b_proj.weight`,
`stack.layers.0.mlp.experts.gate_proj`, `mtp.block.self_attn.w_uk`, ...) and give the roles of
the parameter's OWN trailing dimensions; leading stacked-group axes (the scanned IndexShare
groups, `stack.*`) are never sharded. Every parameter must match exactly one rule (first match
wins); an unmatched path raises, so a new parameter has to be classified here.

Linear weights are stored `[in, out]` (glm53/layers.py). The layout follows docs/design.md §7:
* TP splits attention heads (q_b_proj columns, W_UK/W_UV heads, o_proj rows) and MLP columns
  (gate/up columns, down rows); the latent projections (q_a, kv_a) and the lightning indexer stay
  replicated, so the MLA latent cache is identical on every TP rank (and the indexer's work is
  replicated, as in the source write-up's TP8 baseline).
* EP splits the routed experts over every device; without EP each expert's intermediate columns
  are split over TP.
* lm_head is split over the vocabulary (TP); embeddings, norms, routers are replicated.
"""

from __future__ import annotations

import re

import jax
from flax import nnx
from jax.sharding import NamedSharding

from sharding.mesh import (ATTN_HEADS, EXPERT_COLS, EXPERTS, KV_CONTEXT, KV_REPLICA, MLP_COLS, VOCAB,
                           ParallelLayout)

# (path regex, roles of the trailing dims). Order matters: first match wins.
PARAM_RULES: tuple[tuple[str, tuple], ...] = (
    # attention (MLA): heads split over TP
    (r"self_attn\.q_b_proj\.weight$", (None, ATTN_HEADS)),
    (r"self_attn\.w_uk$", (ATTN_HEADS, None, None)),
    (r"self_attn\.w_uv$", (ATTN_HEADS, None, None)),
    (r"self_attn\.o_proj\.weight$", (ATTN_HEADS, None)),
    (r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", (None, None)),
    (r"self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight$", (None,)),
    # lightning indexer: replicated
    (r"self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight$", (None, None)),
    (r"self_attn\.indexer\.k_norm\.(weight|bias)$", (None,)),
    # routed experts
    (r"mlp\.experts\.(gate_proj|up_proj)$", (EXPERTS, None, EXPERT_COLS)),
    (r"mlp\.experts\.down_proj$", (EXPERTS, EXPERT_COLS, None)),
    (r"mlp\.gate\.weight$", (None, None)),
    (r"mlp\.gate\.e_score_correction_bias$", (None,)),
    # dense MLP and shared experts: columns over TP
    (r"mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$", (None, MLP_COLS)),
    (r"mlp\.(shared_experts\.)?down_proj\.weight$", (MLP_COLS, None)),
    # norms, embedding, head, MTP glue
    (r"(input_layernorm|post_attention_layernorm)\.weight$", (None,)),
    (r"^embed_tokens\.weight$", (None, None)),
    (r"^lm_head\.weight$", (None, VOCAB)),
    (r"^norm\.weight$", (None,)),
    (r"^mtp\.(enorm|hnorm|shared_head_norm)\.weight$", (None,)),
    (r"^mtp\.eh_proj\.weight$", (None, None)),
)


def _path_str(path) -> str:
    """Dotted parameter path from a pytree key path (the Variable's own `.value` leaf dropped)."""
    parts = []
    for p in path:
        for attr in ("key", "idx", "name"):
            if hasattr(p, attr):
                parts.append(str(getattr(p, attr)))
                break
        else:
            parts.append(str(p))
    if parts and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)


def param_roles(path: str, ndim: int) -> tuple:
    """Roles of every dimension of the parameter at dotted `path` with `ndim` dimensions (leading
    stacked axes get None). An FP8 `weight_scale_inv` grid (`….weight_scale_inv`,
    `….w_uk_scale_inv`, `mlp.experts.gate_proj_scale_inv`) is split like its weight: one scale
    per block, and glm53.quant.check_fp8_parallel_layout makes every shard hold whole blocks.
    Raises KeyError for a path no rule matches, ValueError when a rule's rank exceeds the
    parameter's."""
    if path.endswith("_scale_inv"):
        path = path[: -len("_scale_inv")]
    for pattern, roles in PARAM_RULES:
        if re.search(pattern, path):
            if len(roles) > ndim:
                raise ValueError(f"rule {pattern!r} gives {len(roles)} dims for {path} with {ndim}")
            return (None,) * (ndim - len(roles)) + tuple(roles)
    raise KeyError(f"no partition rule for parameter {path!r}; add one to sharding.rules.PARAM_RULES")


def param_shardings(model_or_state, layout: ParallelLayout):
    """A pytree of `NamedSharding`s shaped like the model's parameter state.

    Args:
      model_or_state: a `GlmForCausalLM` (or any NNX module) or its `nnx.State` (`nnx.split(m)[1]`);
        abstract states (`jax.ShapeDtypeStruct` leaves, e.g. from `nnx.eval_shape`) work too.
      layout: the `ParallelLayout`.
    Returns:
      an `nnx.State` with the same structure whose leaves are `NamedSharding`s: pass it to
      `jax.device_put(state, shardings)`, to `jax.jit(out_shardings=...)` or to orbax restore args.
    Raises:
      KeyError: a parameter no rule covers. ValueError: a sharded dimension that the shard count does
      not divide (names the parameter, dimension and layout).
    """
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state

    def one(path, leaf):
        shape = leaf.shape
        roles = param_roles(_path_str(path), len(shape))
        for d, r in enumerate(roles):
            n = layout.size(r)
            if n > 1 and shape[d] % n:
                raise ValueError(_split_error(_path_str(path), d, shape[d], n, r, layout))
        return layout.sharding(*roles)

    return jax.tree_util.tree_map_with_path(one, state)


# The flag that sets each mesh axis's size (vLLM's names).
_AXIS_FLAGS = {"dp": "--data-parallel-size", "pcp": "--prefill-context-parallel-size", "tp": "--tensor-parallel-size"}


def _split_error(path: str, dim: int, size: int, n: int, role: str, layout: ParallelLayout) -> str:
    """The refusal of a parameter dimension `n` shards do not divide: the flags whose product
    `n` is, the sizes that would divide it, and the parameter (for the curious)."""
    axes = [a for a in layout.axes(role) if layout.mesh.shape[a] > 1]
    flags = " × ".join(f"{_AXIS_FLAGS.get(a, a)} {layout.mesh.shape[a]}" for a in axes)
    what = {"experts": "the experts", "attn_heads": "the attention heads", "mlp_cols": "the MLP columns",
            "expert_cols": "the experts' MLP columns", "vocab": "the vocabulary"}.get(role, f"dimension {dim}")
    ok = [k for k in range(1, size + 1) if size % k == 0 and k <= 64]
    via = " (--enable-expert-parallel splits the experts over every device of the mesh)" if role == "experts" else ""
    return (f"{flags} splits {what} ({size} in this model) {n} ways, which does not divide them; "
            f"{'that product' if len(axes) > 1 else 'it'} must divide {size}: one of {', '.join(map(str, ok))}{via} "
            f"(parameter {path} dim {dim}, role {role})")


def shard_params(state, layout: ParallelLayout):
    """`jax.device_put` of a parameter state onto its shardings (the state is not donated)."""
    return jax.device_put(state, param_shardings(state, layout))


def cache_sharding(layout: ParallelLayout) -> NamedSharding:
    """Sharding of the KV arena `uint32[dp · dcp · num_blocks, page_words]`.

    The leading axis is the concatenation of one arena per (DP replica, DCP rank), split over
    `KV_REPLICA` (dp) and `KV_CONTEXT` (the DCP axes); every other axis (TP, and PCP when the KV is
    not sharded over it) holds a replica, so the latent cache is replicated across TP.
    """
    return layout.sharding((KV_REPLICA, KV_CONTEXT), None)


def arena_shards(layout: ParallelLayout) -> int:
    """How many distinct arenas the global arena concatenates (dp × dcp)."""
    return layout.size(KV_REPLICA, KV_CONTEXT)
