"""Which implementation the kernel dispatchers pick when the caller does not name one.

Each op's `api.py` (sparse MLA, the indexer top-k, the hot-buffer resolver, the FP8 matmuls)
takes `implementation=` and `interpret=`; the model never passes them, so this module decides for
every op at once:

* `"auto"` (default): the Pallas kernels on a GPU backend, the pure-JAX references elsewhere;
* `"reference"`: the references everywhere (the oracle, also on a GPU: compare a served stream
  through the kernels with one through the references on the same device);
* `"pallas"`: the Pallas kernels everywhere — in interpret mode where the backend is not a GPU;
* `"interpret"`: the Pallas kernels in interpret mode on any backend (the GPU code path of the
  engine's own jitted programs, run on CPU);
* `"triton"`: the Pallas kernels for a GPU (never interpret mode) on any backend: for lowering
  and exporting programs for CUDA from a machine without a GPU (`jax.export` with
  `platforms=("cuda",)`); running such a program on a CPU fails.

Set it with the environment variable `GLM53_KERNELS` (read when an op is traced) or, for a block
of code, `with use_kernels("interpret"): ...` (which wins over the variable). The choice is made
when a program is traced: a compiled program keeps the kernels it was traced with. An engine
reads the mode once, when it is built, and traces every step program under it.

A Pallas kernel that cannot take a call's configuration (shapes, dtypes, block sizes: each op's
`unsupported_reason`) falls back to the reference when the mode chose it, with one warning per op
and reason; an explicit `implementation=` raises instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os

import jax

logger = logging.getLogger(__name__)

KERNEL_MODE_ENV = "GLM53_KERNELS"
MODES = ("auto", "reference", "pallas", "interpret", "triton")
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("glm53_kernel_mode", default=None)
_warned: set[tuple[str, str]] = set()


def kernel_mode() -> str:
    """The active mode: a `use_kernels` block's, else `GLM53_KERNELS`, else "auto".
    Raises ValueError for a value outside `MODES`."""
    mode = _override.get() or os.environ.get(KERNEL_MODE_ENV, "") or "auto"
    if mode not in MODES:
        raise ValueError(f"{KERNEL_MODE_ENV}={mode!r}: choose one of {', '.join(MODES)}")
    return mode


@contextlib.contextmanager
def use_kernels(mode: str):
    """Within the block, ops traced choose their implementation by `mode` (one of `MODES`;
    ValueError otherwise)."""
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}: choose one of {', '.join(MODES)}")
    token = _override.set(mode)
    try:
        yield
    finally:
        _override.reset(token)


def choose(implementation: str | None, interpret: bool) -> tuple[str, bool]:
    """An op's `(implementation, interpret)` → the `(name, interpret)` to run: an explicit
    `implementation`, or `interpret=True`, is kept as given; otherwise the active mode decides."""
    if implementation is not None:
        return implementation, interpret
    if interpret:
        return "pallas_triton", True
    mode = kernel_mode()
    on_gpu = jax.default_backend() == "gpu"
    if mode == "reference" or (mode == "auto" and not on_gpu):
        return "xla", False
    if mode == "interpret" or (mode == "pallas" and not on_gpu):
        return "pallas_triton", True
    return "pallas_triton", False  # "triton", or "auto" / "pallas" on a GPU


def warn_fallback(op: str, reason: str) -> None:
    """Log once per (op, reason) that the chosen Pallas kernel cannot take a call and the
    reference runs instead."""
    if (op, reason) not in _warned:
        _warned.add((op, reason))
        logger.warning("%s: the Pallas kernel cannot run this call (%s); the reference runs instead", op, reason)
