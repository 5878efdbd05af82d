"""One process of the two-process test (tests/sharding/test_distributed.py).

Joins `jax.distributed` through sharding.distributed, checks that the 2 × 4 simulated CPU devices
form one global mesh of 8, restores the orbax checkpoint straight onto a TP 4 × EP 2 layout (each
process reads only the shards of its own devices) and runs one jitted prefill forward whose
inputs are global arrays; the replicated logits are written to OUT_NPZ. Layout: TP 4 × EP 2
(tests/helpers/param_sharding.py).
Usage: python -m tests.helpers.distributed_worker COORDINATOR PROCESS_ID CKPT_DIR OUT_NPZ PROMPT_IDS
(PROMPT_IDS comma-separated). The device count comes from XLA_FLAGS, set by the parent.
"""

import functools
import os
import sys

import jax

from sharding.distributed import DistributedConfig, initialize, shutdown


def main(coordinator: str, process_id: str, ckpt: str, out: str, prompt: str) -> None:
    initialize(DistributedConfig(coordinator, num_processes=2, process_id=int(process_id), timeout_s=120))
    cache = os.path.join(os.environ.get("GLM53_HOME", os.path.expanduser("~/.cache/glm53")), "jax-compilation-cache")
    jax.config.update("jax_compilation_cache_dir", cache)

    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from glm53.api import _pages, LoadedModel
    from glm53.batch import single_sequence_batch
    from glm53.kv_layout import build_kv_layout
    from glm53.loader import load_model
    from tests.helpers.param_sharding import layout_shardings

    assert jax.process_count() == 2 and jax.local_device_count() == 4 and jax.device_count() == 8
    model = load_model(ckpt, shardings=layout_shardings(jax.devices(), tp=4, ep=2), progress=False)
    leaf = model.stack.layers[0].mlp.experts.gate_proj[...]
    mesh = leaf.sharding.mesh
    assert {d.process_index for d in mesh.devices.flat} == {0, 1} and mesh.size == 8
    assert not leaf.is_fully_addressable and len(leaf.addressable_shards) == 4

    layout = build_kv_layout(model.cfg, "float32")
    ids = [int(x) for x in prompt.split(",")]
    lm = LoadedModel(model, layout, None, ckpt)
    pages, nblocks = _pages(lm, len(ids))
    batch = single_sequence_batch(layout, ids, 0, pages, logits_all=True)
    rep = NamedSharding(mesh, P())
    put = lambda x: jax.device_put(np.asarray(x), rep)  # noqa: E731  same value on every process
    batch = jax.tree.map(put, batch)
    arena = put(np.zeros((nblocks, layout.page_words), np.uint32))
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, out_shardings=rep)
    def logits_fn(state, batch, arena):
        return nnx.merge(graphdef, state)(batch, arena, layout)[0]

    logits = np.asarray(logits_fn(state, batch, arena))
    np.save(out, logits)
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:6])
