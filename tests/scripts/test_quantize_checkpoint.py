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
