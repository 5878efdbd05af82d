"""Which host-row mechanism a backend uses by default.

"memory_kind" on the CPU (and any backend other than a GPU): the pool is a `pinned_host`
`jax.Array` and every host access is a contiguous slice moved between memory kinds, the design the
project is built around. "callback" on a GPU until measured otherwise: XLA's GPU while loops with
a data-dependent trip count synchronise with the host every iteration, so the memory-kind
mechanism's one-row-per-iteration loop is expected to cost a host round trip per missed row, while
the callback moves a whole chunk of rows per call (`scripts/probe_host_gather.py` measures both on
an H200; `hisparse_config.host_gather` overrides).
"""

from __future__ import annotations

import jax


def default_mechanism(backend: str | None = None) -> str:
    """"callback" on a GPU backend, "memory_kind" elsewhere."""
    backend = backend or jax.default_backend()
    return "callback" if backend in ("gpu", "cuda", "rocm") else "memory_kind"
