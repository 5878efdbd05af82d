"""Parameter shardings for the checkpoint and multi-process tests, in the `ShardingSpec` callable
form of glm53/orbax_checkpoint.py (abstract parameter pytree → pytree of `NamedSharding`).

`layout_shardings(devices, tp, ep)` uses the production partition rules of sharding/rules.py
(TP over heads and MLP columns; with ep > 1: `data_parallel_size = ep` and experts split over all
tp·ep devices) when that module is present, and otherwise a simple stand-in rule on an
("ep", "tp") mesh: routed experts split over `ep` on their expert axis, every matrix split over
`tp` on its last (output) axis when that divides, everything else replicated. Either way a
parameter whose layout is non-trivial is split over the devices, which is all the tests need:
they compare against the single-device run.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:  # the production rules (sharding branch)
    from sharding.mesh import ParallelConfig, ParallelLayout
    from sharding.rules import param_shardings
except ImportError:  # pragma: no cover - depends on the merge state
    ParallelLayout = None


def make_mesh(devices, ep: int, tp: int) -> Mesh:
    """Mesh ("ep", "tp") of shape (ep, tp) over the first ep·tp of `devices`."""
    return Mesh(np.asarray(list(devices)[: ep * tp], dtype=object).reshape(ep, tp), ("ep", "tp"))


def simple_rules(mesh: Mesh):
    """The stand-in rule on an ("ep", "tp") mesh (see the module docstring)."""
    ep, tp = mesh.shape["ep"], mesh.shape["tp"]

    def one(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        spec = [None] * x.ndim
        if "experts" in names and x.ndim >= 3 and x.shape[-3] % ep == 0:
            spec[-3] = "ep"
        if x.ndim >= 2 and x.shape[-1] % tp == 0:
            spec[-1] = "tp"
        return NamedSharding(mesh, P(*spec))

    return lambda tree: jax.tree_util.tree_map_with_path(one, tree)


def layout_shardings(devices, tp: int, ep: int = 1):
    """TP `tp` (× EP over `tp · ep` devices when ep > 1) on the first tp·ep of `devices`."""
    devices = list(devices)[: tp * ep]
    if ParallelLayout is not None:
        layout = ParallelLayout.create(ParallelConfig(tensor_parallel_size=tp, data_parallel_size=ep,
                                                      enable_expert_parallel=ep > 1), devices=devices)
        return lambda tree: param_shardings(tree, layout)
    return simple_rules(make_mesh(devices, ep, tp))
