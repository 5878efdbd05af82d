"""What a traced program calls: its nested jaxprs and the Pallas kernels in them.

Used to check, on any backend, that a jitted program really runs the Pallas kernels (a silent
fallback to the pure-JAX reference changes no result, only the speed), by the test suite and by
`scripts/gpu_check.py`, which reports the kernels of each engine it serves.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.extend  # jax.extend.core below (not imported by `import jax`)


def subjaxprs(eqn):
    """The jaxprs nested in an equation's parameters (jit, scan, while, cond, shard_map, custom_vjp)."""
    for p in eqn.params.values():
        for x in (p if isinstance(p, (tuple, list)) else (p,)):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def pallas_kernels(closed_jaxpr) -> Counter:
    """Name → count of every `pallas_call` in `closed_jaxpr` (a `jax.make_jaxpr` result), nested
    jaxprs (scan, cond, shard_map, custom_vjp, pjit) included. The name is the one the kernel gave
    `pallas_call` (else its kernel function's)."""
    names: Counter = Counter()

    def walk(j):
        for eq in j.eqns:
            if eq.primitive.name == "pallas_call":
                name = eq.params.get("name")
                if name is None:
                    dbg = getattr(eq.params.get("jaxpr"), "debug_info", None)
                    name = getattr(dbg, "func_name", None) or "?"
                names[str(name).split(" ")[0]] += 1
            for sub in subjaxprs(eq):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return names
