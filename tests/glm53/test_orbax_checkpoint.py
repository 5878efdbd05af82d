"""Orbax checkpoints: conversion from HF safetensors (bf16 and block-FP8), round trip, restore
onto another mesh layout, clear errors. The oracle is always the safetensors loader's result."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn

from glm53 import api, orbax_checkpoint
from glm53.loader import load_model
from glm53.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from glm53.tiny_checkpoint import default_model_dir
from scripts.convert_checkpoint import main as convert

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSE = os.path.join(ROOT, "tests", "fixtures", "hf", "dense")


def _flat(model):
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(orbax_checkpoint.param_tree(model))}


def _assert_same_params(a, b):
    fa, fb = _flat(a), _flat(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and np.array_equal(fa[k], fb[k]), k


@pytest.fixture(scope="module")
def tiny_orbax(tmp_path_factory):
    """The tiny checkpoint (bf16 safetensors) converted with the default (bf16) storage dtype."""
    dst = tmp_path_factory.mktemp("orbax") / "tiny"
    assert convert([str(default_model_dir()), str(dst), "--no-progress"]) == 0
    return str(dst)


def test_round_trip_gives_identical_parameters_and_logits(tiny_orbax):
    """bf16 source stored as bf16 is lossless: restored fp32 parameters equal the safetensors
    loader's bit for bit, and so do the logits of the same compiled forward."""
    manifest = orbax_checkpoint.read_manifest(tiny_orbax)
    assert manifest["dtype"] == "bfloat16" and manifest["with_mtp"]
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(os.listdir(tiny_orbax))
    assert "quantization_config" not in json.load(open(os.path.join(tiny_orbax, "config.json")))

    ref = api.load()
    got = api.load(tiny_orbax)  # detected as orbax by glm53.loader.load_model
    assert got.tokenizer is not None and got.model.mtp is not None
    _assert_same_params(ref.model, got.model)
    ids = ref.tokenizer.encode("The capital of France is")
    np.testing.assert_array_equal(api.forward(ref, ids), api.forward(got, ids))

    no_mtp = load_model(tiny_orbax, with_mtp=False, progress=False)
    assert no_mtp.mtp is None and no_mtp.cfg.num_nextn_predict_layers == 0


def _quantise_fp8(tensors):
    """Block-FP8 (e4m3, 128×128, non-power-of-two scales) version of an HF tensor dict."""
    out = {}
    rng = np.random.default_rng(1)
    for k, w in tensors.items():
        if (k.endswith("_proj.weight") or k.endswith("wq_b.weight") or k.endswith("wk.weight")) and w.ndim == 2 \
                and "weights_proj" not in k and "eh_proj" not in k:
            w32 = w.astype(np.float32)
            o, i = w32.shape
            bo, bi = -(-o // 128), -(-i // 128)
            pad = np.zeros((bo * 128, bi * 128), np.float32)
            pad[:o, :i] = w32
            blocks = pad.reshape(bo, 128, bi, 128)
            scale = (np.abs(blocks).max(axis=(1, 3)) / 448.0 + 1e-12) * (1 + rng.random((bo, bi)))
            q = (blocks / scale[:, None, :, None]).reshape(bo * 128, bi * 128)[:o, :i]
            out[k] = q.astype(ml_dtypes.float8_e4m3fn)
            out[k[: -len("weight")] + "weight_scale_inv"] = scale.astype(np.float32)
        else:
            out[k] = w
    return out


def test_fp8_source_is_stored_dequantised(tmp_path):
    """An FP8 checkpoint converted with --dtype bfloat16 restores to exactly what loading the FP8
    safetensors dequantised into a bf16 model gives; --dtype float32 to exactly the fp32 load."""
    ck = SafetensorsCheckpoint(DENSE)
    fp8 = _quantise_fp8({k: np.array(ck.get(k)) for k in ck.keys()})
    assert sum(v.dtype == ml_dtypes.float8_e4m3fn for v in fp8.values()) > 20
    src = tmp_path / "fp8"
    src.mkdir()
    cfg = json.load(open(os.path.join(DENSE, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    stn.save_file(fp8, str(src / "model.safetensors"))

    for dtype in ("bfloat16", "float32"):
        dst = tmp_path / f"orbax-{dtype}"
        assert convert([str(src), str(dst), "--dtype", dtype, "--no-progress"]) == 0
        assert orbax_checkpoint.read_manifest(dst)["dtype"] == dtype
        want = load_model(str(src), dtype=getattr(jnp, dtype), progress=False, quantization="none")
        got = load_model(str(dst), dtype=getattr(jnp, dtype), progress=False)
        _assert_same_params(want, got)


def test_missing_or_wrong_directories_fail_clearly(tmp_path, tiny_orbax, capsys):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="not an orbax checkpoint written by glm53"):
        orbax_checkpoint.restore(str(tmp_path / "empty"))

    broken = tmp_path / "broken"
    shutil.copytree(tiny_orbax, broken)
    shutil.rmtree(broken / "params")
    with pytest.raises(CheckpointError, match="parameter directory .* is missing"):
        load_model(str(broken))

    # a converter run onto an existing directory refuses, naming the flag
    assert convert([str(default_model_dir()), tiny_orbax, "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_config_mismatch_names_parameter_and_shapes(tmp_path, tiny_orbax):
    bad = tmp_path / "mismatch"
    shutil.copytree(tiny_orbax, bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["n_routed_experts"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError,
                       match=r"parameter layers\.3\.mlp\.experts\.down_proj is stored with shape \[8, 64, 128\], "
                             r"the config expects \[4, 64, 128\]"):
        load_model(str(bad))


def test_checkpoint_saved_from_tp2_restores_onto_tp4_ep2(tmp_path):
    """In a fresh process with 8 simulated devices: parameters sharded TP 2 are saved; restoring
    onto TP 4 × EP 2 gives the same parameters as placing the safetensors weights on that layout
    (bit for bit), identical logits to that run, and logits equal to the single-device run within
    2e-5 (fp32; sharded matmuls reorder sums)."""
    out = tmp_path / "out.npz"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.orbax_reshard_worker", str(default_model_dir()),
         str(tmp_path / "ckpt"), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    d = np.load(out)
    full = int(np.prod(d["full_shape"]))  # an expert tensor [groups, E, D, I]
    assert int(np.prod(d["shard_a"])) * 2 == full and int(d["devices_a"]) == 2
    assert int(np.prod(d["shard_b"])) * 8 == full and int(d["devices_b"]) == 8
    assert bool(d["params_equal"])
    np.testing.assert_array_equal(d["logits_b"], d["logits_c"])
    np.testing.assert_allclose(d["logits_b"], d["ref"], rtol=0, atol=2e-5)
    assert (d["logits_b"].argmax(-1) == d["ref"].argmax(-1)).all()


def test_a_missing_or_cut_chunk_file_is_named_as_an_incomplete_checkpoint(tmp_path, tiny_orbax):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_orbax, broken)
    chunks = sorted((p for p in (broken / "params").rglob("*") if p.is_file() and p.stat().st_size > 4096),
                    key=lambda p: -p.stat().st_size)
    assert chunks, "no data files found in the orbax checkpoint"
    with open(chunks[0], "r+b") as f:  # the largest data file, cut to half
        f.truncate(chunks[0].stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"the orbax checkpoint .*broken is incomplete or corrupt"):
        load_model(str(broken), progress=False)
    (broken / orbax_checkpoint.MARKER_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"glm53_orbax\.json is not valid JSON .*manifest is damaged"):
        load_model(str(broken), progress=False)
