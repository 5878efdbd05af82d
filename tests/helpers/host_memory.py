"""Which operations of a traced program read values that live in host memory.

On the CPU every operation on a `pinned_host` value "works"; on a GPU, XLA supports only a
contiguous slice of a host array moved to device memory (and a device value moved to host memory
written into one with `dynamic_update_slice`): gathers, scatters and arithmetic on host operands
are rejected or silently become slow host compute (openxla/xla#34565, #47362; jax#34041). The
compiled HLO on CPU shows the host memory space only in the entry layout, while the jaxpr types
every value with its memory space (`uint32<host>[...]`), so the check walks the jaxpr, including
every nested jaxpr (jit, while/fori, scan, cond bodies).
"""

from __future__ import annotations

import jax

from kernels.introspect import subjaxprs

# Reading a host value is allowed only for these: a slice (then moved), the move itself, and
# writing a moved value into a host array. Control flow passes values through; its bodies are
# walked on their own (their inputs carry the host type too).
ALLOWED = {"dynamic_slice", "slice", "device_put", "dynamic_update_slice"}


def _is_host(v) -> bool:
    aval = getattr(v, "aval", None)
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def host_memory_reads(jaxpr) -> list[tuple[str, str]]:
    """(primitive, reason) for every equation, at any depth, that reads a host-memory value and
    is neither in `ALLOWED` nor a control-flow/call primitive whose body is walked instead.
    Also returns the allowed ones under reason "ok" (so a caller can check the path is used)."""
    out = []
    stack = [jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr]
    while stack:
        j = stack.pop()
        for eqn in j.eqns:
            subs = list(subjaxprs(eqn))
            stack.extend(subs)
            if any(_is_host(v) for v in eqn.invars):
                name = eqn.primitive.name
                out.append((name, "ok" if name in ALLOWED or subs else "reads a host-memory operand"))
    return out
