"""Pre-sharded GLM-5.x checkpoints in orbax format: save a model's parameters, restore them onto
any mesh.

A directory written by `save` holds:

* `params/` — an orbax PyTree checkpoint (OCDBT + tensorstore) of the model's parameters in the
  model's own layout (the pure dict of `nnx.state(model, nnx.Param)`: linear weights `[in, out]`,
  experts stacked `[E, in, out]`, `kv_b_proj` split into `w_uk` / `w_uv`, IndexShare groups stacked
  along a leading axis). Nothing is transposed or stacked at load time.
* `config.json` — the HF config (with `quantization_config` dropped: the stored weights are
  dequantised) and, copied from the source directory, the tokenizer, chat template and generation
  config, so the directory serves as `--model` on its own.
* `glm53_orbax.json` — the marker this module detects (`is_orbax_checkpoint`): format name and
  version, stored dtype, whether the MTP layer is present, and the source directory.

Restoring (`restore`) builds the model abstractly (no weights in memory), asks orbax for every
parameter as a `jax.ShapeDtypeStruct` carrying its target sharding, and tensorstore reads for each
device only the chunks that overlap that device's shard: a checkpoint saved from one layout
restores onto any other (resharding happens in the read), and a dtype differing from the stored one
is cast during the read.

FP8 sources. HF block-FP8 checkpoints are dequantised (fp8 × block scale, in fp32) by
`glm53.loader` and stored in the converter's dtype, bf16 by default: the result equals loading the
FP8 safetensors directly into a bf16 model (what the engine does on GPUs). fp8 + scales are not
kept because the model has no FP8 weight path (the loader dequantises anyway) and the 128 × 128
scale blocks do not survive the model's re-layout (`kv_b_proj`'s per-head split at
qk_nope_head_dim = 192 cuts through 128-row blocks); the cost is 2× the disk size of the FP8
source. Use dtype float32 for bit-exact parity with an fp32 load of an FP8 source.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from glm53.config import GlmConfig
from glm53.model import GlmForCausalLM
from glm53.safetensors_reader import CheckpointError

MARKER_FILE = "glm53_orbax.json"
PARAMS_DIR = "params"
FORMAT_NAME = "glm53-orbax-params"
FORMAT_VERSION = 1
# Files copied from the source checkpoint directory (besides config.json, which is rewritten).
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "chat_template.json", "tokenizer.model")

# What `restore(..., shardings=...)` accepts: None (default device), one Sharding for every
# parameter, a pytree of Shardings matching `abstract_params(cfg)`, or a callable that maps that
# abstract pytree (leaves `jax.ShapeDtypeStruct`) to such a pytree.
ShardingSpec = Any


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` is a directory written by `save` (it holds `glm53_orbax.json`)."""
    return os.path.isfile(os.path.join(os.fspath(path), MARKER_FILE))


def param_tree(model: GlmForCausalLM) -> dict:
    """The model's parameters as a nested pure dict of arrays (nnx.List entries keyed by int)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def abstract_model(cfg: GlmConfig, dtype=jnp.float32) -> GlmForCausalLM:
    """`GlmForCausalLM(cfg)` with `jax.ShapeDtypeStruct` leaves (allocates no weights)."""
    return nnx.eval_shape(lambda: GlmForCausalLM(cfg, dtype=dtype))


def abstract_params(cfg: GlmConfig, dtype=jnp.float32) -> dict:
    """The parameter pytree of `GlmForCausalLM(cfg, dtype)` with `jax.ShapeDtypeStruct` leaves."""
    return param_tree(abstract_model(cfg, dtype))


def flatten_tree(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested parameter dict → `{"layers.0.self_attn.w_uk": leaf, ...}` (the loader's paths)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_tree(v, name + "."))
        else:
            out[name] = v
    return out


def _hf_config_for_storage(cfg: GlmConfig, dtype) -> dict:
    raw = dict(cfg.raw) if cfg.raw else cfg.to_hf_config()
    raw.pop("quantization_config", None)  # stored weights are dequantised
    raw["torch_dtype"] = jnp.dtype(dtype).name
    raw["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
    return raw


def save(model: GlmForCausalLM, path: str | os.PathLike, *, source_dir: str | os.PathLike | None = None,
         overwrite: bool = False, compress: bool = False, progress: bool = True) -> str:
    """Write `model`'s parameters (in their current dtype and sharding) as an orbax checkpoint.

    Args:
      model: a loaded `GlmForCausalLM`; its arrays may be sharded over any mesh (each process
        writes the shards it holds; call on every process of a multi-process run).
      path: the checkpoint directory to create.
      source_dir: an HF checkpoint directory whose tokenizer / chat template / generation config
        files are copied alongside (missing ones are skipped).
      overwrite: replace an existing directory; otherwise an existing `path` raises.
      compress: zstd-compress the chunks (orbax's own default). Off by default: restores run
        ≈1.8× faster without it (1.1 GiB bf16 on CPU, scripts/bench_checkpoint_load.py as of 93c5f03) and
        random-like bf16 weights shrink only ≈20%.
      progress: show a progress bar over the writing stages.

    Returns the absolute path. Raises FileExistsError when `path` exists and not `overwrite`,
    ValueError when `path` is `source_dir`, contains it or lies inside it (`glm53.output_dir`),
    ValueError for a model with FP8 weights kept (orbax checkpoints store dequantised weights:
    load with `quantization="none"`, as scripts/convert_checkpoint.py does).
    """
    import orbax.checkpoint as ocp

    if model.quant is not None:
        raise ValueError("orbax checkpoints store dequantised weights: load the FP8 checkpoint with "
                         "quantization='none' before saving (scripts/convert_checkpoint.py does)")

    out = os.path.abspath(os.fspath(path))
    if source_dir is not None:
        from glm53.output_dir import check_output_dir

        check_output_dir(source_dir, out)
    if os.path.exists(out):
        if not overwrite:
            raise FileExistsError(f"{out} already exists (pass overwrite=True / --overwrite to replace it)")
        if jax.process_index() == 0:
            shutil.rmtree(out)
    tree = param_tree(model)
    leaves = jax.tree.leaves(tree)
    dtypes = sorted({jnp.dtype(x.dtype).name for x in leaves})
    with tqdm(total=3, desc="saving orbax checkpoint", disable=not progress, unit="stage") as bar:
        if jax.process_index() == 0:
            os.makedirs(out, exist_ok=True)
        _sync("glm53-orbax-save-start")
        bar.set_postfix_str("parameters")
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=compress)).save(
            os.path.join(out, PARAMS_DIR), tree)
        bar.update()
        if jax.process_index() == 0:
            bar.set_postfix_str("config and tokenizer")
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(_hf_config_for_storage(model.cfg, model.dtype), f, indent=2, sort_keys=True)
            copied = []
            if source_dir is not None:
                for name in SIDE_FILES:
                    src = os.path.join(os.fspath(source_dir), name)
                    if os.path.isfile(src):
                        shutil.copyfile(src, os.path.join(out, name))
                        copied.append(name)
            bar.update()
            manifest = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "params_dir": PARAMS_DIR,
                "dtype": jnp.dtype(model.dtype).name,
                "dtypes": dtypes,
                "with_mtp": model.mtp is not None,
                "compressed": compress,
                "num_parameters": int(sum(int(np.prod(x.shape)) for x in leaves)),
                "bytes": int(sum(x.nbytes for x in leaves)),
                "source": os.path.abspath(os.fspath(source_dir)) if source_dir is not None else None,
                "copied_files": copied,
            }
            with open(os.path.join(out, MARKER_FILE), "w") as f:  # last: marks a complete checkpoint
                json.dump(manifest, f, indent=2)
        bar.update(bar.total - bar.n)
    _sync("glm53-orbax-save-done")  # nobody returns before the marker exists
    return out


def _sync(name: str) -> None:
    """Barrier across processes (no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def read_manifest(path: str | os.PathLike) -> dict:
    """The `glm53_orbax.json` of a checkpoint directory.

    Raises FileNotFoundError for a missing directory and CheckpointError for a directory that is
    not (or not a complete) checkpoint written by `save`, or one of another format version.
    """
    d = os.fspath(path)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"checkpoint directory not found: {d}")
    marker = os.path.join(d, MARKER_FILE)
    if not os.path.isfile(marker):
        raise CheckpointError(f"{d} is not an orbax checkpoint written by glm53 (no {MARKER_FILE}; "
                              "convert an HF directory with scripts/convert_checkpoint.py)")
    try:
        with open(marker) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{marker} is not valid JSON ({e}): the orbax checkpoint's manifest is damaged; "
                              "convert the checkpoint again (scripts/convert_checkpoint.py)") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{marker} must be a JSON object: the orbax checkpoint's manifest is damaged")
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{marker}: format {manifest.get('format')!r} version {manifest.get('version')!r}; "
                              f"this build reads {FORMAT_NAME!r} version {FORMAT_VERSION}")
    params = os.path.join(d, manifest.get("params_dir", PARAMS_DIR))
    if not os.path.isdir(params):
        raise CheckpointError(f"{d}: parameter directory {params} is missing (incomplete copy?)")
    return manifest


def stored_shapes(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{dotted parameter path: (shape, dtype name)}` as stored in the checkpoint's orbax metadata."""
    import orbax.checkpoint as ocp

    manifest = read_manifest(path)
    meta = ocp.PyTreeCheckpointer().metadata(os.path.join(os.fspath(path), manifest.get("params_dir", PARAMS_DIR)))
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
    return {k: (tuple(v.shape), jnp.dtype(v.dtype).name) for k, v in flatten_tree(tree).items()}


def check_against_config(path: str | os.PathLike, cfg: GlmConfig, *, with_mtp: bool = True) -> None:
    """Raise CheckpointError listing every parameter the model for `cfg` expects that the
    checkpoint lacks or stores with another shape (and, when `with_mtp` is false, ignoring the
    stored MTP layer); unexpected stored parameters are listed too."""
    stored = stored_shapes(path)
    expected = {k: tuple(v.shape) for k, v in flatten_tree(abstract_params(cfg)).items()}
    problems = []
    for k, shape in expected.items():
        if k not in stored:
            problems.append(f"missing parameter {k} (expected shape {list(shape)})")
        elif stored[k][0] != shape:
            problems.append(f"parameter {k} is stored with shape {list(stored[k][0])}, the config expects {list(shape)}")
    for k in sorted(set(stored) - set(expected)):
        if not with_mtp and k.startswith("mtp."):
            continue
        problems.append(f"unexpected parameter {k} with shape {list(stored[k][0])}")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError(f"orbax checkpoint {os.fspath(path)} does not match its config.json: "
                              + "; ".join(problems[:10]) + more)


def resolve_shardings(spec: ShardingSpec, target: dict) -> dict:
    """A pytree of `jax.sharding.Sharding` matching `target` (see `ShardingSpec`)."""
    if spec is None:
        spec = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(spec, jax.sharding.Sharding):
        return jax.tree.map(lambda _: spec, target)
    if callable(spec):
        spec = spec(target)
    if isinstance(spec, nnx.State):
        spec = nnx.to_pure_dict(spec)
    shard_leaves = jax.tree.leaves(spec, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(shard_leaves) != len(jax.tree.leaves(target)):
        raise ValueError(f"shardings: {len(shard_leaves)} leaves for {len(jax.tree.leaves(target))} parameters")
    return jax.tree.map(lambda _, s: s, target, spec)


def _chunks(tree: dict) -> list[tuple[str, dict]]:
    """Split the parameter tree into restore units (top-level entries, `layers` per layer)."""
    out = []
    for k, v in tree.items():
        if k in ("layers", "stack") and isinstance(v, Mapping):
            for k2, v2 in v.items():
                out.append((f"{k}.{k2}", {k: {k2: v2}}))
        else:
            out.append((k, {k: v}))
    return out


def _merge(dst: dict, src: Mapping) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping):
            _merge(dst.setdefault(k, {}), v)
        else:
            dst[k] = v


def restore_params(path: str | os.PathLike, cfg: GlmConfig, *, dtype=jnp.float32, shardings: ShardingSpec = None,
                   progress: bool = True) -> dict:
    """Read the parameter pytree of `GlmForCausalLM(cfg, dtype)` from an orbax checkpoint.

    Each leaf is restored as a `jax.Array` of the model's dtype for it (`dtype`; the MoE router
    stays float32) with the sharding `shardings` assigns it
    (see `ShardingSpec`); tensorstore reads, per device, only the chunks overlapping its shard.
    Raises CheckpointError when the stored shapes do not match `cfg` (all mismatches listed), or
    when a stored chunk cannot be read (a file missing or cut short).
    """
    import orbax.checkpoint as ocp

    manifest = read_manifest(path)
    with_mtp = cfg.num_mtp_layers > 0
    check_against_config(path, cfg, with_mtp=with_mtp)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params(cfg, dtype))
    sh = resolve_shardings(shardings, target)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, sh)
    params_dir = os.path.join(os.path.abspath(os.fspath(path)), manifest.get("params_dir", PARAMS_DIR))
    ckptr = ocp.PyTreeCheckpointer()
    restored: dict = {}
    units = _chunks(target)
    for name, sub in tqdm(units, desc="restoring weights", disable=not progress, unit="group"):
        args = ocp.args.PyTreeRestore(item=sub, restore_args=ocp.checkpoint_utils.construct_restore_args(sub),
                                      partial_restore=True)
        try:
            _merge(restored, ckptr.restore(params_dir, args=args))
        except Exception as e:  # orbax / tensorstore raise bare Exceptions for a missing or short chunk
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"the orbax checkpoint {path} is incomplete or corrupt: reading the parameters "
                                  f"of {name!r} from {params_dir} failed ({type(e).__name__}: {first[:300]}); "
                                  "convert it again (scripts/convert_checkpoint.py)") from e
    return restored


def restore(path: str | os.PathLike, *, dtype=jnp.float32, shardings: ShardingSpec = None, with_mtp: bool = True,
            progress: bool = True) -> GlmForCausalLM:
    """Config + parameters of an orbax checkpoint directory → a ready `GlmForCausalLM`.

    Args:
      path: a directory written by `save` / scripts/convert_checkpoint.py.
      dtype: the model's parameter dtype (the stored dtype is cast while reading; the MoE router
        stays float32 as in `GlmForCausalLM`).
      shardings: where each parameter goes (see `ShardingSpec`; default: the first local device).
      with_mtp: restore the MTP layer (False skips it even when stored).
      progress: tqdm bar over the restore units.

    Raises FileNotFoundError (no directory), CheckpointError (not a glm53 orbax checkpoint, or
    parameters that do not match config.json), ConfigError (unservable config.json).
    """
    read_manifest(path)
    cfg = GlmConfig.from_pretrained(path)
    if not with_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    params = restore_params(path, cfg, dtype=dtype, shardings=shardings, progress=progress)
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def shard_model(model: GlmForCausalLM, shardings: ShardingSpec) -> GlmForCausalLM:
    """Move a loaded model's parameters onto `shardings` (see `ShardingSpec`), in place."""
    graphdef, state = nnx.split(model)
    tree = nnx.to_pure_dict(state)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    sh = resolve_shardings(shardings, target)
    nnx.replace_by_pure_dict(state, jax.device_put(tree, sh))
    nnx.update(model, state)
    return model


__all__ = [
    "ShardingSpec",
    "abstract_params",
    "check_against_config",
    "is_orbax_checkpoint",
    "param_tree",
    "read_manifest",
    "resolve_shardings",
    "restore",
    "restore_params",
    "save",
    "shard_model",
    "stored_shapes",
]
