"""Which Pallas kernels a traced program calls (for tests that must see the GPU kernels inside
the engine's own jitted programs), and the arguments to trace an engine's step with."""

from __future__ import annotations

from collections import Counter

from tests.helpers.host_memory import subjaxprs


def pallas_kernels(closed_jaxpr) -> Counter:
    """Name → count of every `pallas_call` in `closed_jaxpr` (a `jax.make_jaxpr` result), nested
    jaxprs (scan, cond, shard_map, custom_vjp, pjit) included. The name is the one the kernel gave
    `pallas_call` (else its kernel function's)."""
    names: Counter = Counter()

    def walk(j):
        for eq in j.eqns:
            if eq.primitive.name == "pallas_call":
                # The `name` the kernel passed to pallas_call, else its kernel function's name.
                name = eq.params.get("name")
                if name is None:
                    dbg = getattr(eq.params.get("jaxpr"), "debug_info", None)
                    name = getattr(dbg, "func_name", None) or "?"
                names[str(name).split(" ")[0]] += 1
            for sub in subjaxprs(eq):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return names


def step_args(runner, hot: bool) -> tuple:
    """Arguments of an engine runner's jitted step (`serving.runner.ModelRunner._step`) for its
    first bucket, as its own start-up compile builds them: padding rows that write nothing; with
    `hot`, HiSparse's hot program (the runner must have HiSparse), else the plain one."""
    batch, extra = runner._dummy(runner.buckets[0])
    hs = runner._hisparse_args() if hot else None
    if not hot:
        batch.hot = None
    return (runner._state_leaves, runner._place(batch), runner.kv_arena, *extra, hs, runner._dummy_spec)
