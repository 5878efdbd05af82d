"""scripts/quantize_checkpoint.py: a bf16/fp32 checkpoint → its FP8 block-scaled copy, which loads
with FP8 weights kept and equals quantising the same checkpoint at load (`--quantization fp8`)."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from glm53.loader import load_model
from glm53.safetensors_reader import SafetensorsCheckpoint
from glm53.tiny_checkpoint import default_model_dir
from scripts.quantize_checkpoint import main
from tests.helpers.fp8_checkpoint import is_quantised


def test_quantized_copy_loads_as_fp8_and_equals_online_quantisation(tmp_path, capsys):
    src, dst = str(default_model_dir()), str(tmp_path / "fp8")
    assert main([src, dst, "--no-progress"]) == 0
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [128, 128]
    assert os.path.exists(os.path.join(dst, "tokenizer.json"))
    ck, orig = SafetensorsCheckpoint(dst), SafetensorsCheckpoint(src)
    for k in orig.keys():  # the test helper's own role list (independent of glm53.quant)
        want = "F8_E4M3" if is_quantised(k, orig.get(k)) else orig.dtype(k)
        assert ck.dtype(k) == want, k
    assert sum(k.endswith("weight_scale_inv") for k in ck.keys()) == sum(
        is_quantised(k, orig.get(k)) for k in orig.keys())
    offline = load_model(dst, progress=False)
    online = load_model(src, quantization="fp8", progress=False)
    assert offline.quant is not None and online.quant is not None
    a = jax.tree.leaves(nnx.state(offline, nnx.Param))
    b = jax.tree.leaves(nnx.state(online, nnx.Param))
    assert any(x.dtype == ml_dtypes.float8_e4m3fn for x in a)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x).astype(np.float32), np.asarray(y).astype(np.float32))
    assert main([src, dst, "--no-progress"]) == 2 and "exists" in capsys.readouterr().err
    assert main([dst, str(tmp_path / "again"), "--no-progress"]) == 2 and "already quantised" in capsys.readouterr().err


def test_an_output_over_the_source_is_refused_and_a_failed_run_leaves_nothing(tmp_path, capsys):
    """With --overwrite, DST = SRC (or a folder above it) used to delete the source checkpoint."""
    import shutil

    from scripts.convert_checkpoint import main as convert

    src = tmp_path / "parent" / "src"
    shutil.copytree(default_model_dir(), src)
    before = sorted(os.listdir(src))
    for tool in (main, convert):
        for dst in (src, src.parent, src / "inside"):
            assert tool([str(src), str(dst), "--overwrite", "--no-progress"]) == 2
            assert "output directory" in capsys.readouterr().err
    assert sorted(os.listdir(src)) == before and sorted(os.listdir(src.parent)) == ["src"]
    # A source that fails half-way (a truncated shard) leaves no DST and no partial directory.
    f = src / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 64)
    assert main([str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "is truncated" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["parent"]


def test_the_quantised_shard_is_readable_as_other_files(tmp_path):
    dst = tmp_path / "fp8"
    old = os.umask(0o022)
    try:
        assert main([str(default_model_dir()), str(dst), "--no-progress"]) == 0
    finally:
        os.umask(old)
    modes = {p: os.stat(dst / p).st_mode & 0o777 for p in os.listdir(dst)}
    assert set(modes.values()) == {0o644}, modes
