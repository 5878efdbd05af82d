"""Load HF safetensors checkpoints (bf16, fp32 or FP8 block-scaled) into `GlmForCausalLM`.

* Single-file and sharded (`model.safetensors.index.json`) directories.
* FP8 block-scaled checkpoints (`quantization_config.quant_method = "fp8"`, e4m3): every quantised
  linear has `weight` (float8_e4m3fn `[out, in]`) and `weight_scale_inv` (fp32
  `[ceil(out/B0), ceil(in/B1)]`, block size `weight_block_size`, default 128×128); the real weight
  is fp8 × the scale of its block. Weights are dequantised to the model dtype at load.
* Per-expert keys `mlp.experts.E.{gate,up,down}_proj.weight` are stacked into expert tensors;
  `kv_b_proj` is split into the absorbed `w_uk`/`w_uv`; linear weights are transposed to
  `[in, out]`; the repeating IndexShare groups are stacked along a leading axis.
* Shared layers carry no indexer weights; the MTP layer is `model.layers.{num_hidden_layers}`.
* A missing, unexpected or mis-shaped tensor raises `CheckpointError` naming the key and the
  expected shape (the table is `glm53.checkpoint_keys.expected_checkpoint_shapes`).
* `load_model` also accepts a pre-sharded orbax directory (glm53/orbax_checkpoint.py), detected by
  its `glm53_orbax.json`.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from glm53.checkpoint_keys import expected_checkpoint_shapes
from glm53.config import GlmConfig
from glm53.model import GlmForCausalLM
from glm53.safetensors_reader import CheckpointError, SafetensorsCheckpoint

Getter = Callable[[str], np.ndarray]


def dequantize_fp8_block(w_fp8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """`w [out, in]` float8 × per-block scale `[ceil(out/b0), ceil(in/b1)]` → float32 `[out, in]`."""
    out, inn = w_fp8.shape
    b0, b1 = block
    expect = (math.ceil(out / b0), math.ceil(inn / b1))
    if tuple(scale_inv.shape) != expect:
        raise CheckpointError(f"weight_scale_inv shape {tuple(scale_inv.shape)} != expected {expect} for weight {w_fp8.shape}")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, axis=0), b1, axis=1)[:out, :inn]
    return w_fp8.astype(np.float32) * s


def _layer_sources(cfg: GlmConfig, p: str, has_indexer: bool, moe: bool) -> dict[str, Callable[[Getter], np.ndarray]]:
    """Our relative parameter path → builder from HF tensors under prefix `p` (`model.layers.N`)."""
    N, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
    T = lambda k: (lambda g: g(f"{p}.{k}").T)  # noqa: E731  linear: [out, in] -> [in, out]
    D = lambda k: (lambda g: g(f"{p}.{k}"))  # noqa: E731

    def kv_b(g):
        w = g(f"{p}.self_attn.kv_b_proj.weight")
        return w.reshape(N, -1, w.shape[-1])  # [N, dn + dv, A]

    src = {
        "input_layernorm.weight": D("input_layernorm.weight"),
        "post_attention_layernorm.weight": D("post_attention_layernorm.weight"),
        "self_attn.q_a_proj.weight": T("self_attn.q_a_proj.weight"),
        "self_attn.q_a_layernorm.weight": D("self_attn.q_a_layernorm.weight"),
        "self_attn.q_b_proj.weight": T("self_attn.q_b_proj.weight"),
        "self_attn.kv_a_proj_with_mqa.weight": T("self_attn.kv_a_proj_with_mqa.weight"),
        "self_attn.kv_a_layernorm.weight": D("self_attn.kv_a_layernorm.weight"),
        "self_attn.w_uk": lambda g: kv_b(g)[:, :dn, :],
        "self_attn.w_uv": lambda g: np.swapaxes(kv_b(g)[:, dn:, :], 1, 2),
        "self_attn.o_proj.weight": T("self_attn.o_proj.weight"),
    }
    if has_indexer:
        src.update({
            "self_attn.indexer.wq_b.weight": T("self_attn.indexer.wq_b.weight"),
            "self_attn.indexer.wk.weight": T("self_attn.indexer.wk.weight"),
            "self_attn.indexer.k_norm.weight": D("self_attn.indexer.k_norm.weight"),
            "self_attn.indexer.k_norm.bias": D("self_attn.indexer.k_norm.bias"),
            "self_attn.indexer.weights_proj.weight": T("self_attn.indexer.weights_proj.weight"),
        })
    if moe:
        E = cfg.n_routed_experts

        def experts(name):
            return lambda g: np.stack([g(f"{p}.mlp.experts.{e}.{name}.weight").T for e in range(E)])

        src.update({
            "mlp.gate.weight": T("mlp.gate.weight"),
            "mlp.gate.e_score_correction_bias": D("mlp.gate.e_score_correction_bias"),
            "mlp.experts.gate_proj": experts("gate_proj"),
            "mlp.experts.up_proj": experts("up_proj"),
            "mlp.experts.down_proj": experts("down_proj"),
        })
        if cfg.n_shared_experts:
            for k in ("gate_proj", "up_proj", "down_proj"):
                src[f"mlp.shared_experts.{k}.weight"] = T(f"mlp.shared_experts.{k}.weight")
    else:
        for k in ("gate_proj", "up_proj", "down_proj"):
            src[f"mlp.{k}.weight"] = T(f"mlp.{k}.weight")
    return src


def parameter_sources(cfg: GlmConfig) -> dict[str, Callable[[Getter], np.ndarray]]:
    """Every parameter path of `GlmForCausalLM(cfg)` → how to build it from HF tensors."""
    plan = cfg.layer_plan
    src: dict[str, Callable[[Getter], np.ndarray]] = {
        "embed_tokens.weight": lambda g: g("model.embed_tokens.weight"),
        "norm.weight": lambda g: g("model.norm.weight"),
        "lm_head.weight": (lambda g: g("model.embed_tokens.weight").T) if cfg.tie_word_embeddings
        else (lambda g: g("lm_head.weight").T),
    }
    for k, i in enumerate(plan.head):
        for rel, fn in _layer_sources(cfg, f"model.layers.{i}", cfg.indexer_types[i] == "full",
                                      cfg.mlp_layer_types[i] == "sparse").items():
            src[f"layers.{k}.{rel}"] = fn
    for j in range(plan.group_size if plan.num_stacked_groups else 0):
        per_group = [
            _layer_sources(cfg, f"model.layers.{plan.stacked_layer(gi, j)}", j == 0, True)
            for gi in range(plan.num_stacked_groups)
        ]
        for rel in per_group[0]:
            fns = [pg[rel] for pg in per_group]
            src[f"stack.layers.{j}.{rel}"] = (lambda fns: lambda g: np.stack([f(g) for f in fns]))(fns)
    if cfg.num_mtp_layers:
        L = cfg.num_hidden_layers
        p = f"model.layers.{L}"
        src["mtp.enorm.weight"] = lambda g: g(f"{p}.enorm.weight")
        src["mtp.hnorm.weight"] = lambda g: g(f"{p}.hnorm.weight")
        src["mtp.eh_proj.weight"] = lambda g: g(f"{p}.eh_proj.weight").T
        src["mtp.shared_head_norm.weight"] = lambda g: g(f"{p}.shared_head.norm.weight")
        for rel, fn in _layer_sources(cfg, p, True, True).items():
            src[f"mtp.block.{rel}"] = fn
    return src


def _param_table(model: nnx.Module) -> dict[str, nnx.Param]:
    return {".".join(str(x) for x in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Param)}


def check_checkpoint(cfg: GlmConfig, ckpt: SafetensorsCheckpoint, include_mtp: bool = True) -> None:
    """Raise CheckpointError on the first missing, unexpected or mis-shaped tensor (all listed)."""
    expected = expected_checkpoint_shapes(cfg, include_mtp=include_mtp)
    quant = (cfg.quantization_config or {})
    block = tuple(quant.get("weight_block_size", (128, 128)))
    problems: list[str] = []
    present = set(ckpt.keys())
    for key, (shape, _) in expected.items():
        if key not in present:
            problems.append(f"missing tensor {key} (expected shape {list(shape)})")
        elif tuple(ckpt.shape(key)) != tuple(shape):
            problems.append(f"tensor {key} has shape {list(ckpt.shape(key))}, expected {list(shape)}")
    for key in sorted(present - set(expected)):
        if key.endswith(".weight_scale_inv") and key[: -len("_scale_inv")] in expected:
            wshape = expected[key[: -len("_scale_inv")]][0]
            exp = [math.ceil(wshape[0] / block[0]), math.ceil(wshape[1] / block[1])]
            if list(ckpt.shape(key)) != exp:
                problems.append(f"tensor {key} has shape {list(ckpt.shape(key))}, expected {exp}")
            continue
        if not include_mtp and key.startswith(f"model.layers.{cfg.num_hidden_layers}."):
            continue
        problems.append(f"unexpected tensor {key} with shape {list(ckpt.shape(key))}")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError(f"checkpoint {ckpt.directory} does not match the config: "
                              + "; ".join(problems[:10]) + more)


def load_weights(model: GlmForCausalLM, ckpt: SafetensorsCheckpoint | str, *, progress: bool = True) -> GlmForCausalLM:
    """Fill `model`'s parameters from a checkpoint directory (in place; returns the model).

    Raises CheckpointError (key + expected shape) for missing / unexpected / mis-shaped tensors.
    """
    cfg = model.cfg
    if isinstance(ckpt, str):
        ckpt = SafetensorsCheckpoint(ckpt)
    include_mtp = model.mtp is not None
    check_checkpoint(cfg, ckpt, include_mtp=include_mtp)
    block = tuple((cfg.quantization_config or {}).get("weight_block_size", (128, 128)))

    def get(key: str) -> np.ndarray:
        w = ckpt.get(key)
        scale_key = key[: -len("weight")] + "weight_scale_inv" if key.endswith(".weight") else None
        if scale_key and scale_key in ckpt:
            return dequantize_fp8_block(w, ckpt.get(scale_key), block)
        return w

    params = _param_table(model)
    sources = parameter_sources(cfg)
    missing = sorted(set(params) - set(sources))
    if missing:
        raise CheckpointError(f"no checkpoint source for model parameters {missing[:5]}")
    for path in tqdm(sorted(params), desc="loading weights", disable=not progress, unit="tensor"):
        param = params[path]
        value = np.asarray(sources[path](get))
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(f"{path}: built shape {value.shape} != parameter shape {param.shape}")
        param.set_value(jnp.asarray(value, dtype=param.dtype))
    return model


def load_model(path: str, *, dtype=jnp.float32, with_mtp: bool = True, progress: bool = True,
               shardings=None) -> GlmForCausalLM:
    """Config + weights from a checkpoint directory → a ready `GlmForCausalLM`.

    `path` is an HF safetensors directory or an orbax directory written by
    `glm53.orbax_checkpoint.save` / scripts/convert_checkpoint.py (detected by its
    `glm53_orbax.json`). `shardings` (see `glm53.orbax_checkpoint.ShardingSpec`) places the
    parameters: an orbax checkpoint is read straight into those shards; safetensors weights are
    loaded on the default device, then moved. Raises FileNotFoundError for a missing directory and
    CheckpointError for a directory that is neither format or that does not match its config.
    """
    from glm53 import orbax_checkpoint

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if orbax_checkpoint.is_orbax_checkpoint(path):
        return orbax_checkpoint.restore(path, dtype=dtype, shardings=shardings, with_mtp=with_mtp,
                                        progress=progress)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path} is not a checkpoint directory: it has no config.json "
                              f"(expected an HF safetensors directory or a glm53 orbax checkpoint)")
    cfg = GlmConfig.from_pretrained(path)
    if not with_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    model = GlmForCausalLM(cfg, dtype=dtype)
    model = load_weights(model, SafetensorsCheckpoint(path), progress=progress)
    if shardings is not None:
        orbax_checkpoint.shard_model(model, shardings)
    return model
