"""Dispatch for sparse MLA: picks an implementation for the backend, falling back to the reference.

Only the pure-JAX reference exists in this build; Pallas GPU implementations register here.
"""

from __future__ import annotations

from kernels.sparse_mla.reference import sparse_mla_reference

IMPLEMENTATIONS = {"xla": sparse_mla_reference}


def sparse_mla(q_TNC, kv_arena, topk_slots_TK, layer, *, layout, component="mla", kv_lora_rank, scale,
               implementation: str | None = None):
    """`(o_lat [T,N,A] fp32, lse [T,N] fp32)`; see `reference.sparse_mla_reference` for the contract."""
    impl = IMPLEMENTATIONS[implementation or "xla"]
    return impl(q_TNC, kv_arena, topk_slots_TK, layer, layout=layout, component=component,
                kv_lora_rank=kv_lora_rank, scale=scale)
