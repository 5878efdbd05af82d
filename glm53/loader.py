"""Load HF safetensors checkpoints (bf16, fp32 or FP8 block-scaled) into `GlmForCausalLM`.

* Single-file and sharded (`model.safetensors.index.json`) directories.
* FP8 block-scaled checkpoints (`quantization_config.quant_method = "fp8"`, e4m3): every quantised
  linear has `weight` (float8_e4m3fn `[out, in]`) and `weight_scale_inv` (fp32
  `[ceil(out/B0), ceil(in/B1)]`, block size `weight_block_size`, default 128×128); the real weight
  is fp8 × the scale of its block. By default (vLLM's) they stay FP8 on the device with their
  scales (`glm53.quant`: which parameters, and what happens where a split cuts a block);
  `quantization="none"` dequantises them to the model dtype instead. `quantization="fp8"` on a
  bf16/fp32 checkpoint quantises its linears at load to 128×128 blocks (online, tensor by tensor).
* Per-expert keys `mlp.experts.E.{gate,up,down}_proj.weight` are stacked into expert tensors;
  `kv_b_proj` is split into the absorbed `w_uk`/`w_uv`; linear weights are transposed to
  `[in, out]`; the repeating IndexShare groups are stacked along a leading axis.
* Shared layers carry no indexer weights; the MTP layer is `model.layers.{num_hidden_layers}`. A
  checkpoint without it (HF transformers' `save_pretrained` writes neither the MTP tensors nor
  `num_nextn_predict_layers`) loads without MTP and says so in one log line.
* Streaming (`load_model`): the model is built abstractly (`nnx.eval_shape`, nothing allocated)
  and each parameter's shards are read straight from the memory-mapped safetensors into their
  devices — with `shardings` each device (each process) reads only its own shard; a stacked
  parameter whose shard is large is assembled on the device a few layers at a time. Host memory
  holds at most one tensor's worth of staging (`MAX_STAGING_BYTES` per piece, or one checkpoint
  tensor when it must be dequantised or quantised whole), never the model. A tqdm bar counts GB.
* A missing, unexpected or mis-shaped tensor raises `CheckpointError` naming the key and the
  expected shape (the table is `glm53.checkpoint_keys.expected_checkpoint_shapes`).
* `load_model` also accepts a pre-sharded orbax directory (glm53/orbax_checkpoint.py), detected by
  its `glm53_orbax.json`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from tqdm import tqdm

from glm53.checkpoint_keys import expected_checkpoint_shapes
from glm53.config import GlmConfig
from glm53.model import GlmForCausalLM
from glm53.quant import (QuantizationError, WeightQuant, check_fp8_parallel_layout, checkpoint_block,
                         is_quantized_linear, resolve_weight_quant)
from glm53.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from kernels.fp8_matmul.reference import quantize_fp8_blocks_np

logger = logging.getLogger(__name__)


def dequantize_fp8_block(w_fp8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """`w [out, in]` float8 × per-block scale `[ceil(out/b0), ceil(in/b1)]` → float32 `[out, in]`."""
    out, inn = w_fp8.shape
    b0, b1 = block
    expect = (math.ceil(out / b0), math.ceil(inn / b1))
    if tuple(scale_inv.shape) != expect:
        raise CheckpointError(f"weight_scale_inv shape {tuple(scale_inv.shape)} != expected {expect} for weight {w_fp8.shape}")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, axis=0), b1, axis=1)[:out, :inn]
    return w_fp8.astype(np.float32) * s


class Source:
    """A model parameter not yet read: `read(index)` builds the part `index` (a tuple of slices over
    the parameter's dims, or None for all of it) from the checkpoint."""

    def read(self, index=None) -> np.ndarray:
        raise NotImplementedError


class Leaf(Source):
    """A parameter built from one checkpoint tensor by `fn()` (a memory-mapped view when no
    arithmetic is needed: only the pages of the part read are touched)."""

    def __init__(self, fn: Callable[[], np.ndarray]):
        self.fn = fn

    def read(self, index=None) -> np.ndarray:
        a = self.fn()
        return np.array(a if index is None else a[tuple(index)])


class Stack(Source):
    """A parameter stacked along a new leading axis from `parts` (experts, IndexShare groups)."""

    def __init__(self, parts: list[Source]):
        self.parts = parts

    def read(self, index=None) -> np.ndarray:
        first, rest = (slice(None), None) if index is None else (index[0], tuple(index[1:]))
        return np.stack([self.parts[i].read(rest) for i in range(len(self.parts))[first]])


def _scale_key(key: str) -> str:
    return key[: -len("weight")] + "weight_scale_inv"


class TensorReader:
    """The checkpoint's tensors in the three forms the model takes them.

    `plain(key)`: the real values (an FP8 tensor dequantised to float32, others as stored);
    `codes(key)` / `scale(key)`: a quantised linear's float8_e4m3fn codes `[out, in]` and fp32
    `weight_scale_inv` — the checkpoint's own when it stores that tensor as FP8, else quantised
    here to `quant.block` (online quantisation). The loader reads a parameter's codes before its
    scales (sorted paths), so each tensor is quantised once: the last codes are kept, and every
    scale computed (a few hundred MiB for GLM-5.3 in all) until the load ends.
    """

    def __init__(self, ckpt: SafetensorsCheckpoint, ckpt_block: tuple[int, int] | None, quant: WeightQuant | None):
        self.ckpt = ckpt
        self.ckpt_block = ckpt_block or (128, 128)
        self.quant = quant
        self._last_codes: tuple[str, np.ndarray] | None = None
        self._scales: dict[str, np.ndarray] = {}
        self.num_quantized_online = 0

    def _stored_fp8(self, key: str) -> bool:
        return self.ckpt.dtype(key) == "F8_E4M3" and _scale_key(key) in self.ckpt

    def plain(self, key: str) -> np.ndarray:
        w = self.ckpt.get(key)
        if _scale_key(key) in self.ckpt:
            return dequantize_fp8_block(w, self.ckpt.get(_scale_key(key)), self.ckpt_block)
        return w

    def _quantize(self, key: str) -> np.ndarray:
        if self._last_codes is None or self._last_codes[0] != key:
            codes, scale = quantize_fp8_blocks_np(np.asarray(self.plain(key), np.float32), self.quant.block)
            if key not in self._scales:
                self.num_quantized_online += 1
            self._last_codes, self._scales[key] = (key, codes), scale
        return self._last_codes[1]

    def codes(self, key: str) -> np.ndarray:
        return self.ckpt.get(key) if self._stored_fp8(key) else self._quantize(key)

    def scale(self, key: str) -> np.ndarray:
        if self._stored_fp8(key):
            return self.ckpt.get(_scale_key(key))
        if key not in self._scales:
            self._quantize(key)
        return self._scales[key]


def _layer_sources(cfg: GlmConfig, p: str, r: TensorReader, has_indexer: bool, moe: bool,
                   quant: WeightQuant | None) -> dict[str, Source]:
    """Our relative parameter path → its source, for the HF layer under prefix `p` (`model.layers.N`)."""
    N, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim

    def T(k):  # an unquantised linear: [out, in] -> [in, out]
        return Leaf(lambda: r.plain(f"{p}.{k}").T)

    def D(k):
        return Leaf(lambda: r.plain(f"{p}.{k}"))

    def linear(rel: str) -> dict[str, Source]:  # a quantisable linear (glm53.quant)
        key = f"{p}.{rel}.weight"
        if quant is None:
            return {f"{rel}.weight": Leaf(lambda: r.plain(key).T)}
        return {f"{rel}.weight": Leaf(lambda: r.codes(key).T),
                f"{rel}.weight_scale_inv": Leaf(lambda: r.scale(key).T)}

    kvb = f"{p}.self_attn.kv_b_proj.weight"
    src: dict[str, Source] = {
        "input_layernorm.weight": D("input_layernorm.weight"),
        "post_attention_layernorm.weight": D("post_attention_layernorm.weight"),
        "self_attn.q_a_layernorm.weight": D("self_attn.q_a_layernorm.weight"),
        "self_attn.kv_a_layernorm.weight": D("self_attn.kv_a_layernorm.weight"),
    }
    for rel in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"):
        src.update(linear(rel))
    if quant is None:
        def kv_b():
            w = r.plain(kvb)
            return w.reshape(N, -1, w.shape[-1])  # [N, dn + dv, A]

        src["self_attn.w_uk"] = Leaf(lambda: kv_b()[:, :dn, :])
        src["self_attn.w_uv"] = Leaf(lambda: np.swapaxes(kv_b()[:, dn:, :], 1, 2))
    else:  # codes split per head; scale rows refined to g = gcd(b0, dn, dv) (glm53.quant)
        g, b0 = quant.kv_b_row_block(cfg), quant.block[0]

        def codes():
            w = r.codes(kvb)
            return w.reshape(N, -1, w.shape[-1])

        def rows():
            s = r.scale(kvb)
            n_rows = r.ckpt.shape(kvb)[0]
            return s[np.arange(n_rows // g) * g // b0].reshape(N, -1, s.shape[-1])  # [N, (dn+dv)/g, A/b1]

        src["self_attn.w_uk"] = Leaf(lambda: codes()[:, :dn, :])
        src["self_attn.w_uv"] = Leaf(lambda: np.swapaxes(codes()[:, dn:, :], 1, 2))
        src["self_attn.w_uk_scale_inv"] = Leaf(lambda: rows()[:, : dn // g, :])
        src["self_attn.w_uv_scale_inv"] = Leaf(lambda: np.swapaxes(rows()[:, dn // g:, :], 1, 2))
    if has_indexer:
        src.update(linear("self_attn.indexer.wq_b"))
        src.update(linear("self_attn.indexer.wk"))
        src.update({
            "self_attn.indexer.k_norm.weight": D("self_attn.indexer.k_norm.weight"),
            "self_attn.indexer.k_norm.bias": D("self_attn.indexer.k_norm.bias"),
            "self_attn.indexer.weights_proj.weight": T("self_attn.indexer.weights_proj.weight"),
        })
    if moe:
        E = cfg.n_routed_experts

        def experts(name, part):
            return Stack([Leaf(lambda e=e: part(f"{p}.mlp.experts.{e}.{name}.weight").T) for e in range(E)])

        src["mlp.gate.weight"] = T("mlp.gate.weight")
        src["mlp.gate.e_score_correction_bias"] = D("mlp.gate.e_score_correction_bias")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if quant is None:
                src[f"mlp.experts.{name}"] = experts(name, r.plain)
            else:
                src[f"mlp.experts.{name}"] = experts(name, r.codes)
                src[f"mlp.experts.{name}_scale_inv"] = experts(name, r.scale)
        if cfg.n_shared_experts:
            for k in ("gate_proj", "up_proj", "down_proj"):
                src.update(linear(f"mlp.shared_experts.{k}"))
    else:
        for k in ("gate_proj", "up_proj", "down_proj"):
            src.update(linear(f"mlp.{k}"))
    return src


def parameter_sources(cfg: GlmConfig, reader: TensorReader, quant: WeightQuant | None = None) -> dict[str, Source]:
    """Every parameter path of `GlmForCausalLM(cfg, quant=quant)` → its `Source` in `reader`'s checkpoint."""
    plan = cfg.layer_plan
    r = reader
    src: dict[str, Source] = {
        "embed_tokens.weight": Leaf(lambda: r.plain("model.embed_tokens.weight")),
        "norm.weight": Leaf(lambda: r.plain("model.norm.weight")),
        "lm_head.weight": Leaf(lambda: r.plain("model.embed_tokens.weight" if cfg.tie_word_embeddings
                                               else "lm_head.weight").T),
    }
    for k, i in enumerate(plan.head):
        for rel, s in _layer_sources(cfg, f"model.layers.{i}", r, cfg.indexer_types[i] == "full",
                                     cfg.mlp_layer_types[i] == "sparse", quant).items():
            src[f"layers.{k}.{rel}"] = s
    for j in range(plan.group_size if plan.num_stacked_groups else 0):
        per_group = [
            _layer_sources(cfg, f"model.layers.{plan.stacked_layer(gi, j)}", r, j == 0, True, quant)
            for gi in range(plan.num_stacked_groups)
        ]
        for rel in per_group[0]:
            src[f"stack.layers.{j}.{rel}"] = Stack([pg[rel] for pg in per_group])
    if cfg.num_mtp_layers:
        p = f"model.layers.{cfg.num_hidden_layers}"
        src["mtp.enorm.weight"] = Leaf(lambda: r.plain(f"{p}.enorm.weight"))
        src["mtp.hnorm.weight"] = Leaf(lambda: r.plain(f"{p}.hnorm.weight"))
        src["mtp.eh_proj.weight"] = Leaf(lambda: r.plain(f"{p}.eh_proj.weight").T)
        src["mtp.shared_head_norm.weight"] = Leaf(lambda: r.plain(f"{p}.shared_head.norm.weight"))
        for rel, s in _layer_sources(cfg, p, r, True, True, quant).items():
            src[f"mtp.block.{rel}"] = s
    return src


def _param_table(model: nnx.Module) -> dict[str, nnx.Param]:
    return {".".join(str(x) for x in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Param)}


# safetensors dtypes a weight may be stored in (converted to the model's dtype at load), and the
# one FP8 format GLM-5.x checkpoints use (with a `weight_scale_inv` per quantised linear).
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def _dtype_problems(key: str, ckpt: SafetensorsCheckpoint, ndim: int) -> list[str]:
    """What is wrong with the stored dtype of the expected tensor `key` ([] when nothing):
    a float weight, or an F8_E4M3 quantised linear with its scale. An integer tensor would be
    converted by value, an FP8 one without its scale read as real values, and an F8_E5M2 one
    decoded in the wrong format: each loads and serves wrong output, so each is refused here."""
    dt = ckpt.dtype(key)
    quantisable = is_quantized_linear(key, ndim)
    has_scale = key.endswith(".weight") and _scale_key(key) in ckpt
    if dt in FLOAT_DTYPES:
        if has_scale:
            return [(f"tensor {_scale_key(key)} is given for {key}, which is stored as {dt} (block scales go "
                     "with F8_E4M3 weights)")]
        return []
    if dt == "F8_E4M3" and quantisable:
        return [] if has_scale else [f"tensor {key} is stored as F8_E4M3 but its {_scale_key(key)} is missing"]
    allowed = ", ".join(FLOAT_DTYPES) + (", or F8_E4M3 with a weight_scale_inv" if quantisable else "")
    return [f"tensor {key} has dtype {dt}; it must be one of {allowed}"]


def check_checkpoint(cfg: GlmConfig, ckpt: SafetensorsCheckpoint, include_mtp: bool = True) -> None:
    """Raise CheckpointError on the first missing, unexpected, mis-shaped or mis-typed tensor
    (all listed): shapes against `expected_checkpoint_shapes`, dtypes by `_dtype_problems`."""
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
        else:
            problems += _dtype_problems(key, ckpt, len(shape))
    for key in sorted(present - set(expected)):
        if key.endswith(".weight_scale_inv") and key[: -len("_scale_inv")] in expected:
            wshape = expected[key[: -len("_scale_inv")]][0]
            exp = [math.ceil(wshape[0] / block[0]), math.ceil(wshape[1] / block[1])]
            if list(ckpt.shape(key)) != exp:
                problems.append(f"tensor {key} has shape {list(ckpt.shape(key))}, expected {exp}")
            elif ckpt.dtype(key) not in FLOAT_DTYPES:
                problems.append(f"tensor {key} has dtype {ckpt.dtype(key)}; scales must be one of "
                                f"{', '.join(FLOAT_DTYPES)}")
            continue
        if not include_mtp and key.startswith(f"model.layers.{cfg.num_hidden_layers}."):
            continue
        problems.append(f"unexpected tensor {key} with shape {list(ckpt.shape(key))}")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError(f"checkpoint {ckpt.directory} does not match the config: "
                              + "; ".join(problems[:10]) + more)


def _mtp_in_checkpoint(cfg: GlmConfig, ckpt: SafetensorsCheckpoint) -> bool:
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return any(k.startswith(prefix) for k in ckpt.keys())


def resolve_config(path: str, ckpt: SafetensorsCheckpoint, *, with_mtp: bool = True) -> GlmConfig:
    """The checkpoint's config, without the MTP layer when it is not wanted or not there.

    A checkpoint with no `model.layers.{num_hidden_layers}.*` tensor (HF transformers'
    `save_pretrained` writes no MTP tensors and no `num_nextn_predict_layers`) loads without MTP;
    one log line says so (MTP speculation then fails naming `--speculative-config`)."""
    cfg = GlmConfig.from_pretrained(path)
    if cfg.num_mtp_layers and not with_mtp:
        return cfg.replace(num_nextn_predict_layers=0)
    if cfg.num_mtp_layers and not _mtp_in_checkpoint(cfg, ckpt):
        logger.info("%s has no MTP layer (no model.layers.%d.* tensors%s): loading without MTP; MTP speculative "
                    "decoding (--speculative-config) is unavailable", path, cfg.num_hidden_layers,
                    "" if "num_nextn_predict_layers" in (cfg.raw or {}) else ", no num_nextn_predict_layers")
        return cfg.replace(num_nextn_predict_layers=0)
    return cfg


def _model_sources(model: GlmForCausalLM, ckpt: SafetensorsCheckpoint) -> tuple[dict, dict, TensorReader]:
    cfg = model.cfg
    check_checkpoint(cfg, ckpt, include_mtp=model.mtp is not None)
    reader = TensorReader(ckpt, checkpoint_block(cfg), model.quant)
    params = _param_table(model)
    sources = parameter_sources(cfg, reader, model.quant)
    missing = sorted(set(params) - set(sources))
    extra = sorted(set(sources) - set(params))
    if missing or extra:
        raise CheckpointError(f"no checkpoint source for model parameters {missing[:5]}; sources without a "
                              f"parameter {extra[:5]}")
    return params, sources, reader


def load_weights(model: GlmForCausalLM, ckpt: SafetensorsCheckpoint | str, *, progress: bool = True) -> GlmForCausalLM:
    """Fill a concrete `model`'s parameters from a checkpoint directory on their current devices
    (in place; returns the model). FP8 weights follow `model.quant`.

    Raises CheckpointError (key + expected shape) for missing / unexpected / mis-shaped tensors.
    """
    if isinstance(ckpt, str):
        ckpt = SafetensorsCheckpoint(ckpt)
    params, sources, _ = _model_sources(model, ckpt)
    for path in tqdm(sorted(params), desc="loading weights", disable=not progress, unit="tensor"):
        param = params[path]
        value = sources[path].read()
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(f"{path}: built shape {value.shape} != parameter shape {param.shape}")
        param.set_value(jnp.asarray(value, dtype=param.dtype))
        ckpt.release()
    return model


# Staging bound: a stacked parameter whose shard exceeds this is assembled on its devices a few
# parts (IndexShare groups, experts) at a time.
MAX_STAGING_BYTES = 256 << 20


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(buf: jax.Array, piece: jax.Array, start) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(buf, piece, start, 0)


@functools.cache
def _zeros_program(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
    """A jitted `zeros(shape, dtype)` placed on `sharding`, one per distinct triple (a fresh
    lambda per parameter compiled a program each time, stacked parameters of one shape included)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _local_shards(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> list[list]:
    """This process's distinct shards of a `shape` array under `sharding`: `[index, *devices
    holding it]` each (replicas of one shard share an entry)."""
    by_index: dict[tuple, list] = {}
    for dev, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((sl.start, sl.stop) for sl in index)
        by_index.setdefault(key, [index]).append(dev)
    return list(by_index.values())


def _from_shards(src: Source, shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array `shape` with `sharding`, each distinct shard read once from `src` and put
    on the devices holding it before the next one is read."""
    arrays = []
    for index, *devs in _local_shards(shape, sharding):
        host = np.ascontiguousarray(src.read(index), dtype=dtype)
        arrays.extend(jax.device_put(host, d) for d in devs)
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _place(src: Source, shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """Read one parameter onto `sharding`, bounding host staging by `MAX_STAGING_BYTES` where the
    parameter is a stack over an unsharded leading axis."""
    shard = sharding.shard_shape(shape)
    nbytes = math.prod(shard) * np.dtype(dtype).itemsize
    if not (isinstance(src, Stack) and nbytes > MAX_STAGING_BYTES and shard[0] == shape[0] and shape[0] > 1):
        return _from_shards(src, shape, dtype, sharding)
    per = max(1, MAX_STAGING_BYTES // (nbytes // shape[0]))
    buf = _zeros_program(tuple(shape), np.dtype(dtype), sharding)()
    for start in range(0, shape[0], per):
        stop = min(shape[0], start + per)
        piece = _from_shards(Stack(src.parts[start:stop]), (stop - start, *shape[1:]), dtype, sharding)
        buf = _put_rows(buf, piece, start)
    return buf


def _target_shardings(model: GlmForCausalLM, shardings) -> dict[str, jax.sharding.Sharding]:
    """Parameter path → sharding for the (abstract) `model`: one device (None), a
    `ParallelLayout` (sharding/rules.py), or an orbax `ShardingSpec` (glm53/orbax_checkpoint.py)."""
    from glm53 import orbax_checkpoint

    tree = orbax_checkpoint.param_tree(model)  # nested pure dict with ShapeDtypeStruct leaves
    return orbax_checkpoint.flatten_tree(orbax_checkpoint.resolve_shardings(_as_spec(shardings), tree))


def _as_spec(shardings):
    """A `ParallelLayout` as the orbax `ShardingSpec` of its partition rules
    (`sharding.rules.param_shardings`, which also refuses a dimension its shard count does not
    divide); any other spec as given."""
    from sharding.mesh import ParallelLayout
    from sharding.rules import param_shardings

    if isinstance(shardings, ParallelLayout):
        layout = shardings
        return lambda target: param_shardings(target, layout)
    return shardings


def load_model(path: str, *, dtype=jnp.float32, with_mtp: bool = True, progress: bool = True,
               shardings=None, quantization: str | None = None) -> GlmForCausalLM:
    """Config + weights from a checkpoint directory → a ready `GlmForCausalLM`.

    `path` is an HF safetensors directory or an orbax directory written by
    `glm53.orbax_checkpoint.save` / scripts/convert_checkpoint.py (detected by its
    `glm53_orbax.json`). `dtype`: activations and unquantised weights. `quantization` (see
    `glm53.quant.resolve_weight_quant`): None keeps an FP8 checkpoint's weights FP8 on the device,
    "fp8" also quantises a bf16/fp32 checkpoint at load, "none" dequantises an FP8 checkpoint to
    `dtype`. `shardings` places the parameters: a `sharding.mesh.ParallelLayout` (its partition
    rules) or a `glm53.orbax_checkpoint.ShardingSpec`; each device's shard is read straight from
    the memory-mapped files (see the module docstring). Raises FileNotFoundError for a missing
    directory, CheckpointError for a directory that is neither format or that does not match its
    config, QuantizationError (glm53.quant) for a quantisation that cannot apply.
    """
    from glm53 import orbax_checkpoint
    from sharding.mesh import ParallelLayout

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if orbax_checkpoint.is_orbax_checkpoint(path):
        if quantization == "fp8":
            raise QuantizationError(f"--quantization fp8: {path} is an orbax checkpoint, which stores dequantised "
                                    "weights; serve the HF FP8 checkpoint instead")
        return orbax_checkpoint.restore(path, dtype=dtype, shardings=_as_spec(shardings), with_mtp=with_mtp,
                                        progress=progress)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path} is not a checkpoint directory: it has no config.json "
                              f"(expected an HF safetensors directory or a glm53 orbax checkpoint)")
    ckpt = SafetensorsCheckpoint(path)
    cfg = resolve_config(path, ckpt, with_mtp=with_mtp)
    quant = resolve_weight_quant(cfg, quantization)
    if isinstance(shardings, ParallelLayout):
        check_fp8_parallel_layout(cfg, quant, shardings.size)
    model = nnx.eval_shape(lambda: GlmForCausalLM(cfg, dtype=dtype, quant=quant))
    targets = _target_shardings(model, shardings)
    params, sources, reader = _model_sources(model, ckpt)
    total = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in params.values())
    with tqdm(total=total, desc="loading weights", disable=not progress, unit="B", unit_scale=True,
              unit_divisor=1024) as bar:
        for name in sorted(params):
            param = params[name]
            param.set_value(_place(sources[name], tuple(param.shape), param.dtype, targets[name]))
            ckpt.release()  # unmap: pages read so far leave this process's resident set
            bar.update(math.prod(param.shape) * np.dtype(param.dtype).itemsize)
    if reader.num_quantized_online:
        logger.info("quantised %d linear weights to FP8 at load (%s blocks)", reader.num_quantized_online,
                    "x".join(map(str, quant.block)))
    if jax.process_count() > 1:
        mine = sum(_local_shard_bytes(tuple(p.shape), p.dtype, targets[n]) for n, p in params.items())
        logger.info("process %d read %.2f MiB of the %.2f MiB of parameters (its devices' distinct shards)",
                    jax.process_index(), mine / 2**20, total / 2**20)
    return model


def _local_shard_bytes(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> int:
    """Bytes of the distinct shards of a `shape` parameter that this process's devices hold (what
    `_from_shards` reads for it)."""
    return len(_local_shards(shape, sharding)) * math.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize

