"""Run in a fresh process with 8 simulated CPU devices (tests/glm53/test_orbax_checkpoint.py):

1. load the tiny safetensors checkpoint (fp32) and compute the single-device logits of a prompt;
2. shard the parameters as TP 2 (devices 0-1) and save an orbax checkpoint from that layout;
3. restore it onto TP 4 × EP 2 (all 8 devices; tests/helpers/param_sharding.py) and compute the
   logits there;
4. also place the safetensors weights onto that same layout and compute its logits.

Writes an npz: the single-device logits, both layout-B logits, the restored parameters and the
safetensors parameters (gathered), and the shard shapes of one expert tensor before and after.
Usage: python -m tests.helpers.orbax_reshard_worker SRC_DIR CKPT_DIR OUT_NPZ
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_cache = os.path.join(os.environ.get("GLM53_HOME", os.path.expanduser("~/.cache/glm53")), "jax-compilation-cache")
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
import numpy as np  # noqa: E402

from glm53 import api, orbax_checkpoint  # noqa: E402
from glm53.loader import load_model  # noqa: E402
from tests.helpers.param_sharding import ParallelLayout, layout_shardings  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 8, 41, 77, 130, 9, 300, 12]
EXPERT = ("stack", "layers", 0, "mlp", "experts", "gate_proj")


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def main(src: str, ckpt: str, out: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    lm = api.load(src, progress=False)
    ref = api.forward(lm, PROMPT)

    orbax_checkpoint.shard_model(lm.model, layout_shardings(jax.devices(), tp=2))
    leaf_a = _get(orbax_checkpoint.param_tree(lm.model), EXPERT)
    shard_a = leaf_a.addressable_shards[0].data.shape
    orbax_checkpoint.save(lm.model, ckpt, source_dir=src, progress=False)

    rules_b = layout_shardings(jax.devices(), tp=4, ep=2)
    lm_b = api.LoadedModel(load_model(ckpt, shardings=rules_b, progress=False), lm.layout,
                           None, ckpt)
    params_b = orbax_checkpoint.param_tree(lm_b.model)
    leaf = _get(params_b, EXPERT)
    shard_b = leaf.addressable_shards[0].data.shape
    devices_b = len(leaf.sharding.device_set)
    logits_b = api.forward(lm_b, PROMPT)

    lm_c = api.LoadedModel(load_model(src, shardings=rules_b, progress=False), lm.layout, None, src)
    logits_c = api.forward(lm_c, PROMPT)
    params_c = orbax_checkpoint.param_tree(lm_c.model)

    flat_b = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params_b)}
    flat_c = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params_c)}
    same = sorted(flat_b) == sorted(flat_c) and all(np.array_equal(flat_b[k], flat_c[k]) for k in flat_b)
    np.savez(out, ref=ref, logits_b=logits_b, logits_c=logits_c, params_equal=same,
             shard_a=np.array(shard_a), shard_b=np.array(shard_b), devices_b=devices_b,
             devices_a=len(leaf_a.sharding.device_set), full_shape=np.array(leaf.shape), num_params=len(flat_b),
             production_rules=ParallelLayout is not None)


if __name__ == "__main__":
    main(*sys.argv[1:4])
