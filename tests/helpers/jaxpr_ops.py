"""Which Pallas kernels a traced program calls (for tests that must see the GPU kernels inside
the engine's own jitted programs)."""

from __future__ import annotations

from collections import Counter


def pallas_kernels(closed_jaxpr) -> Counter:
    """Name → count of every `pallas_call` in `closed_jaxpr` (a `jax.make_jaxpr` result), nested
    jaxprs (scan, cond, shard_map, custom_vjp, pjit) included. The name is the one the kernel gave
    `pallas_call` (else its kernel function's)."""
    names: Counter = Counter()

    def sub_jaxprs(v):
        if hasattr(v, "eqns"):
            yield v
        elif hasattr(v, "jaxpr"):
            yield from sub_jaxprs(v.jaxpr)
        elif isinstance(v, (tuple, list)):
            for x in v:
                yield from sub_jaxprs(x)

    def walk(j):
        for eq in j.eqns:
            if eq.primitive.name == "pallas_call":
                # The `name` the kernel passed to pallas_call, else its kernel function's name.
                name = eq.params.get("name")
                if name is None:
                    dbg = getattr(eq.params.get("jaxpr"), "debug_info", None)
                    name = getattr(dbg, "func_name", None) or "?"
                names[str(name).split(" ")[0]] += 1
            for v in eq.params.values():
                for sub in sub_jaxprs(v):
                    walk(sub)

    walk(closed_jaxpr.jaxpr)
    return names
