"""scripts/train_tiny.py end to end on its smoke schedule: the losses fall, and the checkpoint it
writes loads through the normal loader and tokenizer and answers through the serving forward
exactly as the training forward does (the shipped `tiny-recall` checkpoint is this script's
output at the full schedule)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53 import api
from glm53.training import train_forward

ROOT = Path(__file__).resolve().parents[2]


def test_quick_training_run_writes_a_servable_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--quick", "--probe-every", "0",
                        "--log-every", "5", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = json.loads((out / "train_log.json").read_text())
    lm = [e["lm"] for e in log["log"]]
    assert lm[-1] < 0.8 * lm[0], lm
    assert {e["phase"] for e in log["log"]} == {"dense", "sparse"}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        assert (out / f).is_file(), f
    loaded = api.load(str(out), dtype=jnp.float32, cache_dtype="float32")
    cfg = loaded.config
    assert cfg.index_topk == 64 and cfg.kv_lora_rank % 128 == 0 and cfg.num_mtp_layers == 1
    assert len(cfg.index_groups) >= 2 and all(len(g) >= 2 for g in cfg.index_groups)
    assert set(cfg.mlp_layer_types) == {"dense", "sparse"}
    ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat: the river"}], enable_thinking=False))
    ids = ids + ids + ids  # > index_topk tokens: sparse selection matters
    ref = np.asarray(api.forward(loaded, ids))
    graphdef, state = nnx.split(loaded.model)
    # One program: eagerly, every op of the forward compiles on its own.
    forward = jax.jit(lambda s: train_forward(nnx.merge(graphdef, s), jnp.asarray([ids]), sparse=True,
                                              mtp=False).logits_BTV[0])
    got = np.asarray(forward(state))
    np.testing.assert_allclose(got, ref, atol=2e-4 * np.abs(ref).max())
