"""Dispatch for the block-scaled FP8 weight matmuls: picks an implementation for the backend,
falling back to the reference.

Implementations (the registry `IMPLEMENTATIONS`; each entry is `(dense, grouped)`):
  "xla"            `reference.fp8_matmul_reference` / `reference.fp8_grouped_matmul_reference`:
                   pure JAX (dequantise, then one dot / `lax.ragged_dot`), the CPU path and the oracle.
  "pallas_triton"  `pallas_triton.fp8_matmul_pallas_triton` / `fp8_grouped_matmul_pallas_triton`:
                   W8A16 Pallas kernels (Triton lowering) reading the fp8 weight once, converting
                   it in registers and applying the block scales to the fp32 partial products.

Default choice (`implementation=None`): "pallas_triton" when JAX's default backend is "gpu" and
`pallas_triton.unsupported_reason` names nothing, else "xla". The Pallas path is skipped
(reference used instead) for: K not a multiple of bk (a partial K block), x neither bfloat16 nor
float32, weights with leading batch axes (dense form), tile sizes that are not powers of two ≥ 16
on a GPU. An explicit `implementation=` is used as given and raises NotImplementedError when
unsupported. `interpret=True` runs the Pallas kernels in interpret mode on any backend (tests)
and selects them unless `implementation` says otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.mode import choose, warn_fallback
from kernels.fp8_matmul.pallas_triton import (fp8_grouped_matmul_pallas_triton, fp8_matmul_pallas_triton,
                                              unsupported_reason)
from kernels.fp8_matmul.reference import fp8_grouped_matmul_reference, fp8_matmul_reference

IMPLEMENTATIONS = {
    "xla": (fp8_matmul_reference, fp8_grouped_matmul_reference),
    "pallas_triton": (fp8_matmul_pallas_triton, fp8_grouped_matmul_pallas_triton),
}


def default_implementation() -> str:
    """What a call without `implementation=` / `interpret=` runs under the active kernel mode
    (`kernels/mode.py`; by default "pallas_triton" on a GPU backend, "xla" elsewhere)."""
    return choose(None, False)[0]


def _choose(op: str, implementation: str | None, interpret: bool, reason_fn) -> tuple[str, bool]:
    """→ (name, interpret) to run; `reason_fn(interpret)` names what the Pallas kernel cannot take."""
    name, interpret = choose(implementation, interpret)
    if name not in IMPLEMENTATIONS:
        raise KeyError(f"unknown fp8_matmul implementation {name!r}; known: {sorted(IMPLEMENTATIONS)}")
    if name == "xla":
        return name, interpret
    reason = reason_fn(interpret)
    if reason is None:
        return name, interpret
    if implementation is not None:
        raise NotImplementedError(f"fp8_matmul {name}: {reason}")
    warn_fallback(op, reason)
    return "xla", False


def fp8_matmul(x: jax.Array, w_fp8: jax.Array, scale_inv: jax.Array, *, block: tuple[int, int], out_dtype=None,
               implementation: str | None = None, interpret: bool = False) -> jax.Array:
    """`x [..., K] @ dequantise(w_fp8 [K, N], scale_inv [ceil(K/bk), ceil(N/bn)])` → `[..., N]` in
    out_dtype (default x.dtype); fp32 accumulation. See `reference.fp8_matmul_reference`
    (which also takes batched weights `[..., K, N]`, always on the reference).

    implementation: None (choose, module docstring), "xla" or "pallas_triton".
    interpret: Pallas interpret mode (tests).
    Raises:
      KeyError: unknown implementation name.
      NotImplementedError: an explicitly requested Pallas configuration it does not support.
    """
    block = tuple(int(b) for b in block)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]) if w_fp8.ndim == 2 else x
    name, interpret = _choose("fp8_matmul", implementation, interpret,
                              lambda i: unsupported_reason(x2, w_fp8, scale_inv, block=block, interpret=i))
    if name == "xla":
        return fp8_matmul_reference(x, w_fp8, scale_inv, block=block, out_dtype=out_dtype)
    y = fp8_matmul_pallas_triton(x2, w_fp8, scale_inv, block=block, out_dtype=out_dtype, interpret=interpret)
    return y.reshape(*lead, w_fp8.shape[-1])


def fp8_grouped_matmul(x: jax.Array, w_fp8: jax.Array, scale_inv: jax.Array, group_sizes: jax.Array, *,
                       block: tuple[int, int], implementation: str | None = None,
                       interpret: bool = False) -> jax.Array:
    """MoE expert matmul: `x [M, K]` (rows sorted by expert) with fp8 expert weights `[E, K, N]`,
    scales `[E, ceil(K/bk), ceil(N/bn)]` and int32 `group_sizes [E]` → float32 `[M, N]`
    (`lax.ragged_dot` semantics; see `reference.fp8_grouped_matmul_reference`).

    implementation: None (choose, module docstring), "xla" or "pallas_triton".
    interpret: Pallas interpret mode (tests).
    Raises:
      KeyError: unknown implementation name.
      NotImplementedError: an explicitly requested Pallas configuration it does not support.
    """
    block = tuple(int(b) for b in block)
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    name, interpret = _choose("fp8_grouped_matmul", implementation, interpret,
                              lambda i: unsupported_reason(x, w_fp8, scale_inv, block=block, grouped=True, interpret=i))
    _, impl = IMPLEMENTATIONS[name]
    if name == "xla":
        return impl(x, w_fp8, scale_inv, group_sizes, block=block)
    return impl(x, w_fp8, scale_inv, group_sizes, block=block, interpret=interpret)
