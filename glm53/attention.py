"""The one boundary between the model and the attention kernels.

Model code calls these three functions; they own the choice of kernel, the `shard_map` and the
partition specs, so changing a kernel or a parallel layout does not touch the model files. All
take the arena `uint32[num_blocks, page_words]` and return it updated where they write (the arena
is threaded functionally and donated at the jit boundary).

With `parallel=None` (one device) the kernels run directly. With a `ParallelLayout` each function
is a `shard_map` over the mesh (tokens split over `TOKENS`, heads over `ATTN_HEADS`, block
tables over `REQUESTS`, the arena over `KV_REPLICA` × `KV_CONTEXT`) and runs one of three modes:

* no DCP — every rank of a replica holds the whole cache: under PCP the new rows of the replica's
  tokens are all-gathered before the cache write (so every PCP rank's cache stays complete), and
  each rank indexes and attends only its own queries (and its own heads under TP).
* DCP over TP ("queries to KV", decode style): rank r stores positions `(p // I) % N == r`
  (sharding/context_parallel.py). The indexer scores each rank's shard, and the per-rank top-k
  lists are merged with the total-order tie rule (`global_topk_merge`). Sparse MLA all-gathers
  the queries' heads, attends the rank's shard for all heads, and the `(o, lse)` partials are
  merged NaN-safe by `ag_rs` (all-gather lse + reduce-scatter o) or `a2a` (all-to-all + local
  merge), leaving each rank its own heads.
* DCP over PCP ("KV to queries", prefill style): the persistent cache stays sharded; per layer the
  shards of the batch's pages are all-gathered into a temporary full copy and each rank runs the
  kernels on its own queries against it.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from glm53.batch import ForwardBatch
from glm53.kv_layout import KVCacheLayout
from kernels.indexer_topk import indexer_topk
from kernels.paged import GroupLayout, gather_rows, positions_to_slots, write_cache
from kernels.sparse_mla import sparse_mla
from sharding import collectives as col
from sharding import context_parallel as cp
from sharding.mesh import ATTN_HEADS, KV_CONTEXT, KV_REPLICA, REQUESTS, TOKENS, ParallelLayout


# ---------------------------------------------------------------------- helpers
def _specs(par: ParallelLayout):
    return dict(
        arena=par.spec((KV_REPLICA, KV_CONTEXT), None),
        tok=par.spec(TOKENS),
        tok2=par.spec(TOKENS, None),
        heads3=par.spec(TOKENS, ATTN_HEADS, None),
        tok3=par.spec(TOKENS, None, None),
        bt=par.spec(REQUESTS, None),
        rep=PartitionSpec(),
    )


def _shard_map(par: ParallelLayout, f, in_specs, out_specs):
    return jax.shard_map(f, mesh=par.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _kv_mode(par: ParallelLayout | None) -> str:
    if par is None or par.is_single_device:
        return "local"
    axes = par.axes(KV_CONTEXT)
    if not axes:
        return "replicated"
    return "dcp_tp" if axes == ("tp",) else "dcp_pcp"


def _dcp_rank(par: ParallelLayout):
    return jax.lax.axis_index(par.axes(KV_CONTEXT))


def _full_copy(kv_arena, block_table_BP, g: GroupLayout, component: str, layer, par: ParallelLayout):
    """Temporary full copy (one layer) of the batch's pages from the DCP shards.

    Every rank gathers its `g`-row share of each block-table page, the shares are all-gathered
    over the DCP axes and reassembled into full `g·N`-token pages. Returns (arena of 1 + B·P pages,
    its GroupLayout with one layer, block table `[B, P]` pointing at it; null stays null).
    """
    n, inter, tpp = par.dcp, par.config.dcp_kv_cache_interleave_size, g.tokens_per_page
    B, P = block_table_BP.shape
    slots = block_table_BP[:, :, None] * tpp + jnp.arange(tpp, dtype=jnp.int32)
    rows = gather_rows(kv_arena, slots, g, component, layer)  # [B, P, g, W]
    allr = jax.lax.all_gather(rows, par.axes(KV_CONTEXT), axis=0)  # [N, B, P, g, W]
    owner, local = cp.dcp_page_gather_index(n, inter, tpp)
    full = allr[owner, :, :, local]  # [g*N, B, P, W]
    full = jnp.moveaxis(full, 0, 2).reshape(B * P, -1)
    temp = jnp.concatenate([jnp.zeros((1, full.shape[1]), full.dtype), full], axis=0)
    _, comp = g.component(component)
    tg = GroupLayout(g.name + "_full", tpp * n, (dataclasses.replace(comp, num_layers=1),))
    ids = 1 + jnp.arange(B * P, dtype=jnp.int32).reshape(B, P)
    return temp, tg, jnp.where(block_table_BP > 0, ids, 0)


# ---------------------------------------------------------------------- cache write
def write_kv(kv_arena: jax.Array, rows_TW: jax.Array, batch: ForwardBatch, layout: KVCacheLayout,
             group: str, component: str, layer, parallel: ParallelLayout | None = None) -> jax.Array:
    """Write this step's new rows `[T, width]` for one layer into the group's pages (slot_mapping).

    Under PCP the rows (and their slots) of all PCP ranks of the replica are all-gathered first;
    under DCP each rank keeps only the rows it owns. Slots are engine slots (pages of
    `tokens_per_page × dcp` tokens).
    """
    g = layout.group(group)
    mode = _kv_mode(parallel)
    if mode == "local":
        return write_cache(kv_arena, rows_TW, batch.slot_mapping[group], g, component, layer)
    par = parallel
    s = _specs(par)
    pcp_axes = ("pcp",) if par.pcp > 1 else ()

    def body(arena, rows, slots, lyr):
        rows = col.all_gather_tiled(rows, pcp_axes)
        slots = col.all_gather_tiled(slots, pcp_axes)
        if mode != "replicated":
            slots = cp.dcp_local_slots(slots, _dcp_rank(par), par.dcp, par.config.dcp_kv_cache_interleave_size,
                                       g.tokens_per_page)
        return write_cache(arena, rows, slots, g, component, lyr)

    f = _shard_map(par, body, (s["arena"], s["tok2"], s["tok"], s["rep"]), s["arena"])
    return f(kv_arena, rows_TW, batch.slot_mapping[group], layer)


# ---------------------------------------------------------------------- indexer
def select_topk(q_TID: jax.Array, w_TI: jax.Array, kv_arena: jax.Array, batch: ForwardBatch,
                layout: KVCacheLayout, group: str, layer, topk: int,
                parallel: ParallelLayout | None = None) -> jax.Array:
    """Indexer top-k: request-local positions `[T, K]` (−1 padding), tie rule of the reference
    (higher score, then lower position) — also across DCP ranks."""
    g = layout.group(group)
    mode = _kv_mode(parallel)
    if mode == "local":
        idx, _ = indexer_topk(q_TID, w_TI, kv_arena, batch.block_tables[group], batch.req_idx_T, batch.positions_T,
                              layer, layout=g, component="indexer", topk=topk)
        return idx
    par = parallel
    s = _specs(par)
    inter = par.config.dcp_kv_cache_interleave_size

    def body(arena, q, w, bt, req, pos, lyr):
        if mode == "replicated":
            idx, _ = indexer_topk(q, w, arena, bt, req, pos, lyr, layout=g, component="indexer", topk=topk)
            return idx
        if mode == "dcp_pcp":
            temp, tg, tbt = _full_copy(arena, bt, g, "indexer", lyr, par)
            idx, _ = indexer_topk(q, w, temp, tbt, req, pos, 0, layout=tg, component="indexer", topk=topk)
            return idx
        r = _dcp_rank(par)
        lim = cp.dcp_causal_limit(pos, r, par.dcp, inter, g.tokens_per_page)
        loc, _, score = indexer_topk(q, w, arena, bt, req, lim, lyr, layout=g, component="indexer", topk=topk,
                                     return_scores=True)
        glob = cp.dcp_global_positions(loc, r, par.dcp, inter, g.tokens_per_page)
        idx, _ = col.global_topk_merge(score, glob, par.axes(KV_CONTEXT))
        return idx

    f = _shard_map(par, body, (s["arena"], s["tok3"], s["tok2"], s["bt"], s["tok"], s["tok"], s["rep"]), s["tok2"])
    return f(kv_arena, q_TID, w_TI, batch.block_tables[group], batch.req_idx_T, batch.positions_T, layer)


# ---------------------------------------------------------------------- sparse MLA
def sparse_attention(q_abs_TNC: jax.Array, kv_arena: jax.Array, topk_TK: jax.Array, batch: ForwardBatch,
                     layout: KVCacheLayout, group: str, layer, *, kv_lora_rank: int, scale: float,
                     parallel: ParallelLayout | None = None) -> jax.Array:
    """Absorbed sparse MLA over the selected positions → `o_lat [T, N, A]` fp32."""
    g = layout.group(group)
    tpp = g.tokens_per_page
    mode = _kv_mode(parallel)
    attend = partial(sparse_mla, component="mla", kv_lora_rank=kv_lora_rank, scale=scale)
    if mode == "local":
        slots = positions_to_slots(topk_TK, batch.block_tables[group], batch.req_idx_T, tpp)
        o, _ = attend(q_abs_TNC, kv_arena, slots, layer, layout=g)
        return o
    par = parallel
    s = _specs(par)
    inter = par.config.dcp_kv_cache_interleave_size

    def body(arena, q, topk, bt, req, lyr):
        if mode == "replicated":
            o, _ = attend(q, arena, positions_to_slots(topk, bt, req, tpp), lyr, layout=g)
            return o
        if mode == "dcp_pcp":
            temp, tg, tbt = _full_copy(arena, bt, g, "mla", lyr, par)
            o, _ = attend(q, temp, positions_to_slots(topk, tbt, req, tg.tokens_per_page), 0, layout=tg)
            return o
        axes = par.axes(KV_CONTEXT)
        q_all = col.all_gather_tiled(q, axes, axis=1)  # every head, for this rank's KV shard
        loc = cp.dcp_local_positions(topk, _dcp_rank(par), par.dcp, inter, tpp)
        o, lse = attend(q_all, arena, positions_to_slots(loc, bt, req, tpp), lyr, layout=g)
        o, _ = col.merge_partials(o, lse, axes, par.config.dcp_comm_backend)
        return o

    f = _shard_map(par, body, (s["arena"], s["heads3"], s["tok2"], s["bt"], s["tok"], s["rep"]), s["heads3"])
    return f(kv_arena, q_abs_TNC, topk_TK, batch.block_tables[group], batch.req_idx_T, layer)


def engine_tokens_per_page(layout: KVCacheLayout, group: str, parallel: ParallelLayout | None = None) -> int:
    """Tokens one engine page of `group` spans: the group's tokens_per_page × the DCP size."""
    n = parallel.dcp if parallel is not None else 1
    return layout.group(group).tokens_per_page * n

