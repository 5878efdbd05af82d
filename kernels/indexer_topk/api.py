"""Dispatch for the indexer top-k: picks an implementation for the backend, falling back to the reference.

Implementations (the registry `IMPLEMENTATIONS`):
  "xla"            `reference.indexer_topk_reference`: pure JAX, the CPU path and the oracle.
  "pallas_triton"  `pallas_triton.indexer_topk_pallas_triton`: Pallas score kernel (Triton
                   lowering) reading the key rows (fp8 included) straight from the arena, with a
                   top-k merge in JAX that selects exactly what the reference's tie rule does.

Default choice (`implementation=None`): "pallas_triton" when JAX's default backend is "gpu",
else "xla". The Pallas path is skipped (reference used instead) when its `unsupported_reason`
names one: key row dtypes without a lane codec in `kernels.pallas_rows` (every row dtype of
`kernels.paged` has one today: float32, bfloat16, fp8_per_token, fp8_per_token_hadamard), indexer
head counts that are not powers of two ≥ 16, key lane widths (Dk / L, L values per word: 1, 2, or
4 for fp8) that are not powers of two ≥ 16, fp8 keys whose width is not a multiple of 4.
`return_scores=True` (the DCP merge) runs on either implementation. An
explicit `implementation=` is used as given and raises NotImplementedError when unsupported.
`interpret=True` runs the Pallas kernel in interpret mode on any backend (tests) and selects it
unless `implementation` says otherwise.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int, UInt32

from kernels.mode import choose, warn_fallback
from kernels.indexer_topk.pallas_triton import indexer_topk_pallas_triton, unsupported_reason
from kernels.indexer_topk.reference import indexer_topk_reference

IMPLEMENTATIONS = {"xla": indexer_topk_reference, "pallas_triton": indexer_topk_pallas_triton}


def default_implementation() -> str:
    """What a call without `implementation=` / `interpret=` runs under the active kernel mode
    (`kernels/mode.py`; by default "pallas_triton" on a GPU backend, "xla" elsewhere)."""
    return choose(None, False)[0]


def indexer_topk(q_TID: Float[Array, "T I D"], w_TI: Float[Array, "T I"], kv_arena: UInt32[Array, "blocks page_words"],
                 block_table_BP: Int[Array, "B P"], req_idx_T: Int[Array, " T"], positions_T: Int[Array, " T"],
                 layer: Int[Array, ""] | int, *, layout, component="indexer", topk: int,
                 return_scores: bool = False, implementation: str | None = None, interpret: bool = False,
                 precision: str | None = None):
    """`(topk_indices [T,K] int32, valid [T] int32)`, plus `scores [T,K]` fp32 with
    `return_scores` (DCP merges per-rank lists by score); see `reference.indexer_topk_reference`.

    implementation: None (choose, module docstring), "xla" or "pallas_triton".
    interpret: Pallas interpret mode (tests). precision: Pallas only; None → "bf16" for bfloat16
      queries, "highest" otherwise.
    Raises:
      KeyError: unknown implementation name.
      NotImplementedError: an explicitly requested Pallas configuration it does not support.
    """
    explicit = implementation is not None
    name, interpret = choose(implementation, interpret)
    impl = IMPLEMENTATIONS[name]
    args = (q_TID, w_TI, kv_arena, block_table_BP, req_idx_T, positions_T, layer)
    if name == "xla":
        return impl(*args, layout=layout, component=component, topk=topk, return_scores=return_scores)
    if precision is None:
        precision = "bf16" if q_TID.dtype == jax.numpy.bfloat16 else "highest"
    reason = unsupported_reason(layout, component, q_TID.shape[1], precision=precision, interpret=interpret)
    if reason is not None and not explicit:
        warn_fallback("indexer_topk", reason)
        return indexer_topk_reference(*args, layout=layout, component=component, topk=topk,
                                      return_scores=return_scores)
    return impl(*args, layout=layout, component=component, topk=topk, precision=precision,
                return_scores=return_scores, interpret=interpret)
