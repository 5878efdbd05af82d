"""Dispatch for the hot-buffer resolver: picks an implementation for the backend, falling back to the reference.

Implementations (the registry `IMPLEMENTATIONS`), bit-identical outputs (all integers):
  "xla"            `reference.hot_resolve_reference`: pure JAX (one lexicographic sort), the CPU
                   path and the oracle.
  "pallas_triton"  `pallas_triton.hot_resolve_pallas_triton`: Pallas kernels lowered through Triton
                   (blocked compares instead of sorts; quadratic in the state width per row).

Default choice (`implementation=None`): "pallas_triton" when JAX's default backend is "gpu",
else "xla". The Pallas kernels are skipped (reference used instead) when their
`unsupported_reason` names one: an empty shape (no tokens, batch rows, pages, hot pages or state
rows, or state width 0), a state width above `pallas_triton.MAX_STATE_WIDTH`, or index spaces
beyond int32. An explicit `implementation=` is used as given and raises NotImplementedError when
unsupported. `interpret=True` runs the Pallas kernels in interpret mode on any backend (tests)
and selects them unless `implementation` says otherwise.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Int

from kernels.mode import choose, warn_fallback
from kernels.hot_resolve.pallas_triton import hot_resolve_pallas_triton, unsupported_reason
from kernels.hot_resolve.reference import dropped_selections, hot_resolve_reference

__all__ = ["IMPLEMENTATIONS", "default_implementation", "dropped_selections", "hot_resolve"]

IMPLEMENTATIONS = {"xla": hot_resolve_reference, "pallas_triton": hot_resolve_pallas_triton}


def default_implementation() -> str:
    """What a call without `implementation=` / `interpret=` runs under the active kernel mode
    (`kernels/mode.py`; by default "pallas_triton" on a GPU backend, "xla" elsewhere)."""
    return choose(None, False)[0]


def hot_resolve(topk_TK: Int[Array, "T K"], req_idx_T: Int[Array, "T"], block_table_BP: Int[Array, "B P"],
                host_table_BP: Int[Array, "B P"], hot_table_BH: Int[Array, "B H"], state_row_B: Int[Array, "B"],
                reset_from_B: Int[Array, "B"], host_row_SM: Int[Array, "S M"], rank_SM: Int[Array, "S M"],
                num_host_blocks: Int[Array, ""] | int, *, tokens_per_page: int, implementation: str | None = None,
                interpret: bool = False):
    """`(slots [T,K], miss_host_row [T·K], miss_slot [T·K], stats [3], host_row_SM, rank_SM)`, all
    int32; see `reference.hot_resolve_reference` for the contract.

    implementation: None (choose, module docstring), "xla" or "pallas_triton".
    interpret: Pallas interpret mode (tests).
    Raises:
      KeyError: unknown implementation name.
      NotImplementedError: an explicitly requested Pallas configuration it does not support.
    """
    args = (topk_TK, req_idx_T, block_table_BP, host_table_BP, hot_table_BH, state_row_B, reset_from_B, host_row_SM,
            rank_SM, num_host_blocks)
    explicit = implementation is not None
    name, interpret = choose(implementation, interpret)
    impl = IMPLEMENTATIONS[name]
    if name == "xla":
        return impl(*args, tokens_per_page=tokens_per_page)
    T, K = topk_TK.shape
    B, P = block_table_BP.shape
    S, M = host_row_SM.shape
    reason = unsupported_reason(T, K, B, P, hot_table_BH.shape[1], S, M, interpret=interpret)
    if reason is not None and not explicit:
        warn_fallback("hot_resolve", reason)
        return hot_resolve_reference(*args, tokens_per_page=tokens_per_page)
    return impl(*args, tokens_per_page=tokens_per_page, interpret=interpret)
