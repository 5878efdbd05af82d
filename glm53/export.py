"""Write a `GlmForCausalLM` back out as an HF `glm_moe_dsa` safetensors checkpoint.

The inverse of `glm53.loader.parameter_sources`: linear weights transposed back to `[out, in]`,
`w_uk`/`w_uv` joined into `kv_b_proj` (`[N·(dn + dv), A]`, per head the dn rows of W_UK then the
dv rows of W_UV), stacked IndexShare groups and stacked experts split into per-layer and
per-expert tensors, the MTP layer as `model.layers.{num_hidden_layers}`. The tensor set is
exactly `glm53.checkpoint_keys.expected_checkpoint_shapes` (bf16 except the fp32 router), so the
normal loader reads the result (tested as a round trip in tests/glm53/test_export.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from glm53.checkpoint_keys import expected_checkpoint_shapes
from glm53.loader import _param_table


def _params(model) -> dict[str, np.ndarray]:
    return {path: np.asarray(node[...], np.float32) for path, node in _param_table(model).items()}


def _layer_tensors(cfg, p: str, get) -> dict[str, np.ndarray]:
    """HF tensors of one decoder layer with prefix `p`, reading our parameters through `get(rel)`
    (None when absent)."""
    out: dict[str, np.ndarray] = {}
    direct = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_a_layernorm.weight",
              "self_attn.kv_a_layernorm.weight", "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias",
              "mlp.gate.e_score_correction_bias")
    linear = ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
              "self_attn.o_proj.weight", "self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight",
              "self_attn.indexer.weights_proj.weight", "mlp.gate.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight", "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
              "mlp.shared_experts.down_proj.weight")
    for k in direct:
        if (v := get(k)) is not None:
            out[f"{p}.{k}"] = v
    for k in linear:
        if (v := get(k)) is not None:
            out[f"{p}.{k}"] = v.T
    w_uk, w_uv = get("self_attn.w_uk"), get("self_attn.w_uv")  # [N, dn, A], [N, A, dv]
    kv_b = np.concatenate([w_uk, np.swapaxes(w_uv, 1, 2)], axis=1)  # [N, dn + dv, A]
    out[f"{p}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    for name in ("gate_proj", "up_proj", "down_proj"):
        if (e := get(f"mlp.experts.{name}")) is not None:
            for j in range(e.shape[0]):
                out[f"{p}.mlp.experts.{j}.{name}.weight"] = e[j].T
    return out


def hf_tensors(model) -> dict[str, np.ndarray]:
    """Every HF checkpoint tensor of `model` as fp32 numpy arrays (keys as in
    `expected_checkpoint_shapes`; the MTP layer included when the model has one). Raises
    ValueError for a model with FP8 weights kept (export the checkpoint itself instead)."""
    if model.quant is not None:
        raise ValueError("exporting a model with FP8 weights kept is not supported: its FP8 checkpoint is the export "
                         "(or load it with quantization='none')")
    cfg, plan = model.cfg, model.cfg.layer_plan
    params = _params(model)
    out = {"model.embed_tokens.weight": params["embed_tokens.weight"], "model.norm.weight": params["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head.weight"].T
    for k, i in enumerate(plan.head):
        out.update(_layer_tensors(cfg, f"model.layers.{i}", lambda rel, k=k: params.get(f"layers.{k}.{rel}")))
    for g in range(plan.num_stacked_groups):
        for j in range(plan.group_size):
            def get(rel, j=j, g=g):
                v = params.get(f"stack.layers.{j}.{rel}")
                return None if v is None else v[g]
            out.update(_layer_tensors(cfg, f"model.layers.{plan.stacked_layer(g, j)}", get))
    if model.mtp is not None:
        p = f"model.layers.{cfg.num_hidden_layers}"
        out[f"{p}.enorm.weight"] = params["mtp.enorm.weight"]
        out[f"{p}.hnorm.weight"] = params["mtp.hnorm.weight"]
        out[f"{p}.eh_proj.weight"] = params["mtp.eh_proj.weight"].T
        out[f"{p}.shared_head.norm.weight"] = params["mtp.shared_head_norm.weight"]
        out.update(_layer_tensors(cfg, p, lambda rel: params.get(f"mtp.block.{rel}")))
    return out


def save_hf_checkpoint(model, path: str | os.PathLike, *, extra_files: dict[str, bytes | str] | None = None,
                       metadata: dict[str, str] | None = None) -> Path:
    """Write `config.json` and `model.safetensors` (dtypes of `expected_checkpoint_shapes`: bf16,
    fp32 router) into `path`, plus `extra_files` {name: content} (tokenizer, chat template, …).

    Raises ValueError when the tensor set differs from the expected checkpoint layout (a bug).
    """
    from safetensors.numpy import save_file

    cfg = model.cfg
    expected = expected_checkpoint_shapes(cfg, include_mtp=model.mtp is not None)
    tensors = hf_tensors(model)
    if set(tensors) != set(expected):
        raise ValueError(f"exported tensors differ from the checkpoint layout: missing {sorted(set(expected) - set(tensors))[:5]}, "
                         f"extra {sorted(set(tensors) - set(expected))[:5]}")
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, (shape, dtype) in sorted(expected.items()):
        v = tensors[name]
        if tuple(v.shape) != tuple(shape):
            raise ValueError(f"{name}: exported shape {v.shape} != expected {shape}")
        arrays[name] = np.ascontiguousarray(v.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))
    save_file(arrays, str(out_dir / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2, sort_keys=True) + "\n")
    for name, content in (extra_files or {}).items():
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(out_dir / name, mode) as f:
            f.write(content)
    return out_dir
