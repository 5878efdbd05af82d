"""`glm53.export`: a loaded model written back out is the checkpoint it was loaded from.

Independent result: the tiny checkpoint's safetensors file, written by `glm53.tiny_checkpoint`
straight from numpy (not through the model); its bf16 values survive bf16 → fp32 → bf16 exactly,
so the exported tensors must equal the original ones bit for bit."""

import json

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from glm53 import api
from glm53.export import hf_tensors, save_hf_checkpoint
from glm53.loader import load_model


def test_export_round_trips_the_tiny_checkpoint(tmp_path):
    lm = api.load(dtype=jnp.float32)
    original = load_file(f"{lm.path}/model.safetensors")
    out = save_hf_checkpoint(lm.model, tmp_path / "ckpt", extra_files={"note.txt": "x"})
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(original)
    for name, v in original.items():
        assert exported[name].dtype == v.dtype, name
        np.testing.assert_array_equal(exported[name].view(np.uint16 if v.dtype.itemsize == 2 else np.uint32),
                                      v.view(np.uint16 if v.dtype.itemsize == 2 else np.uint32), err_msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["indexer_types"] == list(lm.config.indexer_types) and (out / "note.txt").read_text() == "x"
    # And the normal loader reads it back (the MTP layer included).
    again = load_model(str(out), progress=False)
    t1, t2 = hf_tensors(lm.model), hf_tensors(again)
    assert all(np.array_equal(t1[k], t2[k]) for k in t1)
