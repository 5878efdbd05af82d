"""A simple stand-in partition rule for parameter pytrees on a ("ep", "tp") mesh, used by the
checkpoint and multi-process tests: routed experts split over `ep` on their expert axis, every
matrix split over `tp` on its last (output) axis when that divides, everything else replicated.
It only has to be a valid, non-trivial layout; the model's production rules live in
sharding/rules.py."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def make_mesh(devices, ep: int, tp: int) -> Mesh:
    """Mesh ("ep", "tp") of shape (ep, tp) over the first ep·tp of `devices`."""
    return Mesh(np.asarray(list(devices)[: ep * tp], dtype=object).reshape(ep, tp), ("ep", "tp"))


def simple_rules(mesh: Mesh):
    """→ fn(params pytree) -> pytree of NamedSharding (the `ShardingSpec` callable form)."""
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
