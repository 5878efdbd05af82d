"""The one boundary between the model and the attention kernels.

Model code calls these three functions; they own the choice of kernel (and, later, the
`shard_map` and partition specs for DCP/PCP), so changing a kernel or a parallel layout does not
touch the model files. All take the arena `uint32[num_blocks, page_words]` and return it updated
where they write (the arena is threaded functionally and donated at the jit boundary).
"""

from __future__ import annotations

import jax

from glm53.batch import ForwardBatch
from glm53.kv_layout import KVCacheLayout
from kernels.indexer_topk import indexer_topk
from kernels.paged import positions_to_slots, write_cache
from kernels.sparse_mla import sparse_mla


def write_kv(kv_arena: jax.Array, rows_TW: jax.Array, batch: ForwardBatch, layout: KVCacheLayout,
             group: str, component: str, layer) -> jax.Array:
    """Write this step's new rows `[T, width]` for one layer into the group's pages (slot_mapping)."""
    return write_cache(kv_arena, rows_TW, batch.slot_mapping[group], layout.group(group), component, layer)


def select_topk(q_TID: jax.Array, w_TI: jax.Array, kv_arena: jax.Array, batch: ForwardBatch,
                layout: KVCacheLayout, group: str, layer, topk: int) -> jax.Array:
    """Indexer top-k: request-local positions `[T, K]` (−1 padding), tie rule of the reference."""
    idx, _ = indexer_topk(q_TID, w_TI, kv_arena, batch.block_tables[group], batch.req_idx_T, batch.positions_T,
                          layer, layout=layout.group(group), component="indexer", topk=topk)
    return idx


def sparse_attention(q_abs_TNC: jax.Array, kv_arena: jax.Array, topk_TK: jax.Array, batch: ForwardBatch,
                     layout: KVCacheLayout, group: str, layer, *, kv_lora_rank: int, scale: float) -> jax.Array:
    """Absorbed sparse MLA over the selected positions → `o_lat [T, N, A]` fp32."""
    g = layout.group(group)
    slots = positions_to_slots(topk_TK, batch.block_tables[group], batch.req_idx_T, g.tokens_per_page)
    o, _ = sparse_mla(q_abs_TNC, kv_arena, slots, layer, layout=g, component="mla",
                      kv_lora_rank=kv_lora_rank, scale=scale)
    return o
