"""Weight bytes one device holds, from the model's real parameter tree and the partition rules.

The tree is `GlmForCausalLM(cfg, dtype=..., quant=...)` built abstractly (`nnx.eval_shape`: shapes
and dtypes, nothing allocated), so every parameter the engine would place is counted with the
dtype the model really gives it: with a `glm53.quant.WeightQuant` the attention and FFN linears are
float8_e4m3fn codes (1 B per weight) plus fp32 `*_scale_inv` grids (4 B per block; the kv_b grid
refined per head, glm53/quant.py), while embeddings, lm_head, norms, the router (fp32), `eh_proj`
and the indexer's `weights_proj`/`k_norm` keep their own dtypes; without `quant` everything is in
`dtype` (router fp32).

Per device, each parameter is its shard: `sharding.rules.param_shardings` gives its roles and
`NamedSharding.shard_shape` divides every sharded dimension by the number of shards of its role
under the layout (`ParallelLayout.abstract(config)`: an `AbstractMesh`, so an 8-GPU layout is
planned on a 1-CPU machine). Replicated parameters count in full on every device. The layout is
checked as the engine checks it: a dimension its shard count does not divide raises ValueError
(`param_shardings`), an FP8 shard that would cut a scale block raises QuantizationError
(`check_fp8_parallel_layout`).

All results are bytes (int). GLM-5.3 FP8 (block 128×128, bf16 elsewhere, MTP layer included):
≈ 704 GiB in all (the checkpoint's size, docs/design.md §3.7).
"""

from __future__ import annotations

import functools
from collections import Counter

import jax
import jax.numpy as jnp
from flax import nnx

from glm53.config import GlmConfig
from glm53.quant import WeightQuant, check_fp8_parallel_layout
from sharding.mesh import ParallelConfig, ParallelLayout

# Breakdown categories.
FP8 = "fp8"                    # float8_e4m3fn weight codes (1 B per weight)
FP8_SCALES = "fp8_scales"      # fp32 `*_scale_inv` block scales of the FP8 weights
UNQUANTISED = "unquantised"    # everything else, in its own dtype (model dtype, fp32 router)
KINDS = (FP8, FP8_SCALES, UNQUANTISED)

ROUTED_EXPERTS = "routed_experts"  # mlp.experts.*: split over EP (or their columns over TP)
ATTENTION = "attention"            # self_attn.* (MLA projections, W_UK/W_UV, norms, the indexer)
MLP = "mlp"                        # dense MLP, shared experts, router
EMBED_HEAD = "embed_head"          # embed_tokens, lm_head
OTHER = "other"                    # layer norms, final norm, MTP glue (eh_proj, enorm, hnorm, ...)
PARTS = (ROUTED_EXPERTS, ATTENTION, MLP, EMBED_HEAD, OTHER)


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


@functools.lru_cache(maxsize=8)
def _abstract_state(cfg: GlmConfig, dtype_name: str, quant: WeightQuant | None, with_mtp: bool):
    """The model's parameter state with `jax.ShapeDtypeStruct` leaves (cached: the GLM-5.3 tree is
    rebuilt only once per (cfg, dtype, quant, with_mtp))."""
    from glm53.model import GlmForCausalLM

    c = cfg if with_mtp or cfg.num_mtp_layers == 0 else cfg.replace(num_nextn_predict_layers=0)
    model = nnx.eval_shape(lambda: GlmForCausalLM(c, dtype=jnp.dtype(dtype_name), quant=quant))
    return nnx.state(model)


def _kind(path: str, dtype) -> str:
    if path.endswith("_scale_inv"):
        return FP8_SCALES
    return FP8 if jnp.dtype(dtype) == jnp.float8_e4m3fn else UNQUANTISED


def _part(path: str) -> str:
    if ".mlp.experts." in path:
        return ROUTED_EXPERTS
    if ".self_attn." in path:
        return ATTENTION
    if ".mlp." in path:
        return MLP
    if path.startswith(("embed_tokens.", "lm_head.")):
        return EMBED_HEAD
    return OTHER


@functools.lru_cache(maxsize=64)
def _device_params(cfg: GlmConfig, dtype_name: str, quant: WeightQuant | None, with_mtp: bool,
                   parallel: ParallelConfig | None) -> tuple[tuple[str, int, str, str], ...]:
    """(dotted path, bytes on one device, kind, part) for every parameter."""
    from sharding.rules import _path_str, param_shardings

    state = _abstract_state(cfg, dtype_name, quant, with_mtp)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    if parallel is None or parallel.num_devices == 1:
        shapes = [leaf.shape for _, leaf in leaves]
    else:
        layout = ParallelLayout.abstract(parallel)
        check_fp8_parallel_layout(cfg, quant, layout.size)
        shardings = jax.tree_util.tree_leaves(param_shardings(state, layout))
        assert len(shardings) == len(leaves)
        shapes = [s.shard_shape(leaf.shape) for s, (_, leaf) in zip(shardings, leaves)]
    out = []
    for (path, leaf), shape in zip(leaves, shapes):
        name = _path_str(path)
        n = 1
        for d in shape:
            n *= int(d)
        out.append((name, n * jnp.dtype(leaf.dtype).itemsize, _kind(name, leaf.dtype), _part(name)))
    return tuple(out)


def device_parameter_bytes(cfg: GlmConfig, *, dtype, quant: WeightQuant | None,
                           parallel: ParallelConfig | None = None, with_mtp: bool = True) -> dict[str, int]:
    """Bytes of each parameter's shard on one device (dotted path → bytes), arguments as in
    `device_weight_bytes`."""
    return {p: b for p, b, _, _ in _device_params(cfg, _dtype_name(dtype), quant, with_mtp, parallel)}


def device_weight_bytes(cfg: GlmConfig, *, dtype, quant: WeightQuant | None,
                        parallel: ParallelConfig | None = None, with_mtp: bool = True) -> int:
    """Bytes of the parameters ONE device holds under a parallel layout.

    Args:
      cfg: the model config.
      dtype: the model dtype (activations and unquantised weights), e.g. jnp.bfloat16.
      quant: `WeightQuant(block=...)` for FP8 weights on the device, None for all weights in
        `dtype` (router fp32).
      parallel: the layout (`sharding.mesh.ParallelConfig`: tp / dp / pcp / dcp /
        enable_expert_parallel); None = one device. DCP shards only the KV cache, not weights.
      with_mtp: count the MTP layer (when the config has one); False = the model built with
        `num_nextn_predict_layers=0`.
    Returns:
      bytes (the largest device's; every device of these layouts holds the same amount).
    Raises:
      ValueError: a sharded dimension its shard count does not divide.
      glm53.quant.QuantizationError: an FP8 shard that would cut a scale block.
    """
    return sum(b for _, b, _, _ in _device_params(cfg, _dtype_name(dtype), quant, with_mtp, parallel))


def weight_bytes_breakdown(cfg: GlmConfig, *, dtype, quant: WeightQuant | None,
                           parallel: ParallelConfig | None = None, with_mtp: bool = True,
                           by: str = "kind") -> dict[str, int]:
    """`device_weight_bytes` split into categories (bytes per device; the values sum to it).

    by="kind": {"fp8": float8 weight codes, "fp8_scales": fp32 `*_scale_inv` grids,
      "unquantised": everything else in its own dtype}.
    by="part": {"routed_experts", "attention" (MLA + indexer), "mlp" (dense MLP, shared experts,
      router), "embed_head" (embeddings + lm_head), "other" (norms, MTP glue)}.
    Every key is present (0 when empty).
    """
    if by not in ("kind", "part"):
        raise ValueError(f"by must be 'kind' or 'part', got {by!r}")
    keys = KINDS if by == "kind" else PARTS
    acc: Counter[str] = Counter()
    for _, b, kind, part in _device_params(cfg, _dtype_name(dtype), quant, with_mtp, parallel):
        acc[kind if by == "kind" else part] += b
    return {k: acc[k] for k in keys}
