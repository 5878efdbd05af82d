"""Dispatch for the indexer top-k: the reference is the only implementation in this build."""

from __future__ import annotations

from kernels.indexer_topk.reference import indexer_topk_reference

IMPLEMENTATIONS = {"xla": indexer_topk_reference}


def indexer_topk(q_TID, w_TI, kv_arena, block_table_BP, req_idx_T, positions_T, layer, *, layout, component="indexer",
                 topk, return_scores: bool = False, implementation: str | None = None):
    """`(topk_indices [T,K] int32, valid [T] int32)` (+ `scores [T,K]` fp32 with `return_scores`);
    see `reference.indexer_topk_reference`."""
    impl = IMPLEMENTATIONS[implementation or "xla"]
    return impl(q_TID, w_TI, kv_arena, block_table_BP, req_idx_T, positions_T, layer, layout=layout, component=component,
                topk=topk, return_scores=return_scores)
