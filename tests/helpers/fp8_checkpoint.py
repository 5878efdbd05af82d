"""FP8 block-scaled copies of test checkpoints, quantised here with numpy (independent of
`kernels.fp8_matmul`): the DeepSeek-V3 recipe, `scale_inv = amax / 448` per block, codes
`w / scale_inv` rounded to e4m3 (ml_dtypes), for every linear the GLM-5.x FP8 checkpoints
quantise (docs/design.md §3.7): attention projections (indexer `wq_b`/`wk` included), dense MLP, shared
and routed experts; embeddings, head, norms, router, `eh_proj`, `weights_proj` stay as they are."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from glm53.safetensors_reader import SafetensorsCheckpoint

QUANTISED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
             "down_proj", "wq_b", "wk")


def is_quantised(key: str, w: np.ndarray) -> bool:
    return key.endswith(".weight") and w.ndim == 2 and key.split(".")[-2] in QUANTISED


def quantise(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`w [out, in]` → (float8_e4m3fn codes `[out, in]`, fp32 scale_inv `[ceil(out/b0), ceil(in/b1)]`)."""
    w = np.asarray(w, np.float32)
    b0, b1 = block
    O, I = w.shape
    po, pi = -(-O // b0) * b0, -(-I // b1) * b1
    padded = np.zeros((po, pi), np.float32)
    padded[:O, :I] = w
    amax = np.abs(padded.reshape(po // b0, b0, pi // b1, b1)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, b0, 0), b1, 1)[:O, :I]
    codes = np.clip(w / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


def dequantise(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    O, I = codes.shape
    return codes.astype(np.float32) * np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:O, :I]


def fp8_tensors(tensors: dict[str, np.ndarray], block: tuple[int, int]) -> dict[str, np.ndarray]:
    """HF tensors → the FP8 checkpoint's tensors (`weight` codes + `weight_scale_inv`)."""
    out = {}
    for k, w in tensors.items():
        if is_quantised(k, w):
            out[k], out[k[: -len("weight")] + "weight_scale_inv"] = quantise(w, block)
        else:
            out[k] = np.asarray(w)
    return out


def quant_config(block: tuple[int, int]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def write_fp8_checkpoint(src: str, dst: str, block: tuple[int, int] = (128, 128)) -> str:
    """Copy the checkpoint directory `src` to `dst` with its linears quantised (one safetensors
    file, `quantization_config` added to config.json, other files copied)."""
    os.makedirs(dst, exist_ok=True)
    ck = SafetensorsCheckpoint(src)
    save_file(fp8_tensors({k: np.array(ck.get(k)) for k in ck.keys()}, block), os.path.join(dst, "model.safetensors"))
    for name in os.listdir(src):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json" or name == "golden.npz":
            continue
        if name == "config.json":
            with open(os.path.join(src, name)) as f:
                cfg = json.load(f)
            cfg["quantization_config"] = quant_config(block)
            with open(os.path.join(dst, name), "w") as f:
                json.dump(cfg, f, indent=1)
        elif os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst
