"""The one boundary between the model and the attention kernels.

Model code calls these functions (the cache write, the indexer, sparse MLA and, under HiSparse,
the hot-buffer resolver); they own the choice of kernel, the `shard_map` and the
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
* DCP over PCP: the persistent cache stays sharded. The indexer runs queries to KV: the replica's
  index queries are all-gathered over the PCP ranks, every DCP rank scores its own key shard,
  the per-rank top-k lists are merged with the total-order tie rule and each rank keeps its own
  tokens' rows. Sparse MLA reads the other ranks' rows one of two ways, chosen per step on the
  device by which moves fewer rows (`reads_selected_rows`): the rows of the replica's selections
  each rank owns, exchanged with the ranks whose queries selected them (`_owned_slots` +
  `_selected_rows_partials`: `T_replica × top-k` rows, so decode steps), or a temporary copy of
  the pages of the step's requests only, all-gathered a chunk at a time with the chunks' partials
  merged (`_attend_step_pages`: prefill chunks). Both keep what a layer holds at once within one
  block-table row's worth of gathered rows (`copy_budget_rows`: one request at `--max-model-len`),
  whatever `--max-num-seqs` and the step's tokens are.
* DCP over TP × PCP: both at once — the PCP part as above (the copy is still round-robin sharded
  over TP), and the TP part runs queries-to-KV as above.

Under HiSparse (`resolve_hot`, `store_host_pages`) every KV shard (replica × DCP rank) has its own
part of the host pool and its own hot state; `resolve_hot` returns each shard's own slots and
`sparse_attention` reads them (`_attend_resolved`: over DCP-PCP the selected rows, not every page,
are exchanged). docs/hisparse.md, "Parallel layouts".
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from glm53.batch import ForwardBatch
from glm53.hot_cache import NO_DROP, HostAccess, HotState, PagedKV
from glm53.kv_layout import KVCacheLayout
from kernels.host_rows import (copy_host_rows, host_reads, join_column_parts, read_host_rows, rows_moved,
                               scatter_host_rows, sort_misses,
                                split_words, store_pages)
from kernels.hot_resolve import dropped_selections, hot_resolve
from kernels.indexer_topk import indexer_topk
from kernels.paged import GroupLayout, gather_rows, positions_to_slots, write_cache
from kernels.sparse_mla import sparse_mla
from sharding import collectives as col
from sharding import context_parallel as cp
from sharding.mesh import AXES, ATTN_HEADS, KV_CONTEXT, KV_REPLICA, REQUESTS, TOKENS, ParallelLayout


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
    return "dcp" if par.axes(KV_CONTEXT) else "replicated"


def _dcp_axes(par: ParallelLayout) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(DCP axes whose shards are gathered into a temporary copy: those that also split the
    queries' tokens, i.e. pcp; DCP axes kept sharded with queries sent to the KV: tp)."""
    axes = par.axes(KV_CONTEXT)
    return tuple(a for a in axes if a == "pcp"), tuple(a for a in axes if a != "pcp")


def _split_size(par: ParallelLayout, axes) -> int:
    return int(np.prod([par.mesh.shape[a] for a in axes])) if axes else 1


def _gathered_copy(kv_arena, pages_C, g: GroupLayout, component: str, layer, par: ParallelLayout):
    """Temporary copy (one layer) of the engine pages `pages_C [C]`, all-gathered over the DCP axes
    that split the queries' tokens (PCP), for attention of this rank's own queries.

    Each rank gathers its `g`-row share of every listed page; the shares are all-gathered over the
    gathered axes and reassembled. Without a remaining DCP axis the result holds full pages of
    `g·N` tokens; with one (TP × PCP), this TP rank's round-robin share of each page (`g · pcp`
    rows), i.e. a DCP-over-TP shard with pages of `g · pcp` tokens.

    Returns (arena of 1 + C pages: page 1 + i is `pages_C[i]`, page 0 zero; a null entry's page
    holds the null block's rows, which no block table built for the copy points to; its
    GroupLayout with one layer).
    """
    gather, split = _dcp_axes(par)
    n, inter, tpp = par.dcp, par.config.dcp_kv_cache_interleave_size, g.tokens_per_page
    n_split = _split_size(par, split)
    n_gather = n // n_split
    C = pages_C.shape[0]
    slots = pages_C[:, None] * tpp + jnp.arange(tpp, dtype=jnp.int32)
    rows = gather_rows(kv_arena, slots, g, component, layer)  # [C, g, W]
    allr = jax.lax.all_gather(rows, gather, axis=0)  # [n_gather, C, g, W]
    t = jax.lax.axis_index(split) if split else 0
    j = jnp.arange(tpp * n_gather, dtype=jnp.int32)  # row of the temporary page
    o = (j // inter) * inter * n_split + t * inter + j % inter  # its offset in the engine page
    src_rank = ((o // inter) % n) // n_split  # index along the gathered axes (rank = gather · n_split + t)
    src_row = (o // (inter * n)) * inter + o % inter
    part = allr[src_rank, :, src_row]  # [g·n_gather, C, W]
    part = jnp.moveaxis(part, 0, 1).reshape(C, -1)
    temp = jnp.concatenate([jnp.zeros((1, part.shape[1]), part.dtype), part], axis=0)
    _, comp = g.component(component)
    tg = GroupLayout(g.name + "_gathered", tpp * n_gather, (dataclasses.replace(comp, num_layers=1),))
    return temp, tg


def copy_budget_rows(block_table_shape: tuple, g: GroupLayout, par: ParallelLayout) -> int:
    """DCP over PCP: the rows per rank and layer either sparse-MLA path may hold at once — one
    block-table row's worth of gathered pages, i.e. one request at `--max-model-len` (656 B a row in
    FP8): the step-pages copy takes that many pages per chunk (`_attend_step_pages`) and the
    selected-rows exchange that many rows per query block (`_selected_rows_partials`), so neither
    grows with `--max-num-seqs` or with the step's tokens."""
    gather, _ = _dcp_axes(par)
    return int(block_table_shape[1]) * g.tokens_per_page * _split_size(par, gather)


def reads_selected_rows(copied_rows: jax.Array, selected_rows: int) -> jax.Array:
    """DCP over PCP: whether sparse MLA exchanges the selected rows (`selected_rows` = the replica's
    tokens × top-k, gathered and reduce-scattered by every rank) rather than copying the step's
    pages (`copied_rows` = the chunks the step's requests need × the rows a chunk holds, traced).
    Decided per step on the device: decode steps (few tokens over long contexts) exchange
    selections, prefill chunks (many tokens over one context) copy pages."""
    return selected_rows <= copied_rows


def _step_pages(bt, req_all):
    """The pages of the replica's requests in the step (`req_all`: the table rows of all the
    replica's tokens), numbered in block-table order: (used `[B, P]` bool, copy index `[B, P]`,
    count — the same on every rank of the replica)."""
    B, P = bt.shape
    in_step = jnp.zeros((B,), bool).at[req_all].set(True)
    used_BP = in_step[:, None] & (bt > 0)
    order_BP = (jnp.cumsum(used_BP.reshape(-1)) - 1).reshape(B, P)
    return used_BP, order_BP, jnp.sum(used_BP, dtype=jnp.int32)


def _attend_step_pages(q, arena, topk, bt, req, lyr, g: GroupLayout, attend, par: ParallelLayout, chunk: int,
                       step_pages, kv_lora_rank: int):
    """DCP over PCP: sparse MLA of this rank's queries `q [T, N, C]` over a temporary copy of the
    pages of the step's requests only (`step_pages` from `_step_pages`), `chunk` pages at a time.

    The chunks are copied one after the other (`_gathered_copy`), as many as the step needs (a
    dynamic trip count, the same on every rank of the replica); each chunk's partial `(o, lse)` is
    merged into the running result with `lse_merge` (exactly the one-pass result when one chunk
    covers the step). With a TP part of DCP left, the heads are all-gathered and the partials are
    this TP rank's shard's, for the caller's merge.

    Returns (o `[T, N', A]` fp32, lse `[T, N']`): N' = this rank's heads, or all with a TP part.
    """
    _, split = _dcp_axes(par)
    n_split = _split_size(par, split)
    tpp_view = g.tokens_per_page * (par.dcp // n_split)
    used_BP, order_BP, n_used = step_pages
    B, P = bt.shape
    pages = jnp.zeros((B * P + chunk,), jnp.int32).at[jnp.where(used_BP, order_BP, B * P + chunk).reshape(-1)].set(
        bt.reshape(-1), mode="drop")
    if split:
        q = col.all_gather_tiled(q, split, axis=1)
        topk = cp.dcp_local_positions(topk, jax.lax.axis_index(split), n_split, par.config.dcp_kv_cache_interleave_size,
                                      tpp_view)

    def one_chunk(c, acc):
        temp, tg = _gathered_copy(arena, jax.lax.dynamic_slice_in_dim(pages, c * chunk, chunk), g, "mla", lyr, par)
        local = order_BP - c * chunk
        bt_c = jnp.where(used_BP & (local >= 0) & (local < chunk), 1 + local, 0)
        o, lse = attend(q, temp, positions_to_slots(topk, bt_c, req, tpp_view), 0, layout=tg)
        return col.lse_merge(jnp.stack([acc[0], o]), jnp.stack([acc[1], lse]))

    T, N = q.shape[0], q.shape[1]
    acc0 = (jnp.zeros((T, N, kv_lora_rank), jnp.float32), jnp.full((T, N), -jnp.inf, jnp.float32))
    return jax.lax.fori_loop(0, (n_used + chunk - 1) // chunk, one_chunk, acc0)


def _owned_slots(topk, bt, req_all, g: GroupLayout, par: ParallelLayout):
    """DCP over PCP, inside the shard_map: this KV shard's arena slots for the selections of every
    token of its replica (`[T_replica, K]`, −1 where the shard does not own the position), from
    this rank's top-k positions `[T, K]` (all-gathered over the PCP ranks), the table rows of all
    the replica's tokens `req_all` and the block tables."""
    gather, _ = _dcp_axes(par)
    ctx = par.axes(KV_CONTEXT)
    inter, tpp = par.config.dcp_kv_cache_interleave_size, g.tokens_per_page
    topk = col.all_gather_tiled(topk, gather)
    loc = cp.dcp_local_positions(topk, jax.lax.axis_index(ctx), par.dcp, inter, tpp)
    return positions_to_slots(loc, bt, req_all, tpp)


def _query_block(T: int, n_gather: int, K: int, budget_rows: int) -> int:
    """The largest divisor of `T` whose selected rows over the replica (`n_gather · block · K`) fit
    the budget (at least 1)."""
    b = max(1, min(T, budget_rows // max(1, n_gather * K)))
    while T % b:
        b -= 1
    return b


def _selected_rows_partials(arena, q, slots, lyr, g: GroupLayout, attend, par: ParallelLayout, budget_rows: int):
    """DCP over PCP, inside the shard_map: sparse MLA of this rank's queries `q [T, N, C]` over the
    selected rows, exchanged. `slots [T_replica, K]` are this shard's slots for the replica's
    tokens (rank-major, −1 where not owned). Per block of queries, every rank gathers the rows it
    owns for that block of every rank's queries and a reduce-scatter over the PCP ranks gives each
    rank its own queries' rows (each row comes from exactly one rank, the others add zeros),
    attended as a temporary one-page-per-query arena. Blocks of queries keep the gathered rows
    within `budget_rows` (`copy_budget_rows`); one block is the whole step where it fits.

    Returns (o `[T, N', A]` fp32, lse `[T, N']`): N' = this rank's heads, or all with a TP part of
    DCP left (the caller merges them)."""
    gather, split = _dcp_axes(par)
    n_gather = _split_size(par, gather)
    T, K = q.shape[0], slots.shape[1]
    if split:
        q = col.all_gather_tiled(q, split, axis=1)
    _, comp = g.component("mla")
    block = _query_block(T, n_gather, K, budget_rows)
    tg = GroupLayout(g.name + "_selected", K, (dataclasses.replace(comp, num_layers=1),))

    def attend_block(slots_b, q_b):
        rows = gather_rows(arena, slots_b, g, "mla", lyr)  # [n_gather · block, K, W]
        rows = jnp.where((slots_b >= 0)[..., None], rows, 0)
        rows = col.reduce_scatter_tiled(rows, gather, axis=0)  # [block, K, W]: every owned row once
        valid = col.reduce_scatter_tiled((slots_b >= 0).astype(jnp.int32), gather, axis=0) > 0
        temp = jnp.concatenate([jnp.zeros((1, K * rows.shape[2]), rows.dtype), rows.reshape(block, -1)], axis=0)
        sel = (1 + jnp.arange(block, dtype=jnp.int32))[:, None] * K + jnp.arange(K, dtype=jnp.int32)[None, :]
        return attend(q_b, temp, jnp.where(valid, sel, -1), 0, layout=tg)

    if block == T:
        return attend_block(slots, q)
    nb = T // block
    slots_b = slots.reshape(n_gather, nb, block, K).swapaxes(0, 1).reshape(nb, n_gather * block, K)
    o, lse = jax.lax.map(lambda a: attend_block(*a), (slots_b, q.reshape(nb, block, *q.shape[1:])))
    return o.reshape(T, *o.shape[2:]), lse.reshape(T, *lse.shape[2:])


# ---------------------------------------------------------------------- cache write
def write_kv(kv_arena: jax.Array, rows_TW: jax.Array, batch: ForwardBatch, layout: KVCacheLayout,
             group: str, component: str, layer, parallel: ParallelLayout | None = None) -> jax.Array:
    """Write this step's new rows `[T, width]` for one layer into the group's pages (slot_mapping).

    Under PCP the rows (and their slots) of all PCP ranks of the replica are all-gathered first;
    they arrive in load-balanced chunk order and the slot travelling with each row puts it back at
    its position (the order restore). Under DCP each rank keeps only the rows it owns. Slots are engine slots (pages of
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
        if mode == "dcp":
            rank = jax.lax.axis_index(par.axes(KV_CONTEXT))
            slots = cp.dcp_local_slots(slots, rank, par.dcp, par.config.dcp_kv_cache_interleave_size,
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

    gather, _ = _dcp_axes(par)
    ctx = par.axes(KV_CONTEXT)

    def body(arena, q, w, bt, req, pos, lyr):
        if mode == "replicated":
            idx, _ = indexer_topk(q, w, arena, bt, req, pos, lyr, layout=g, component="indexer", topk=topk)
            return idx
        # Queries to KV: every DCP rank scores its own key shard, and the per-rank top-k lists are
        # merged with the total-order tie rule. Over PCP the ranks hold different queries: the
        # replica's queries are all-gathered first and each rank keeps its own rows of the merge.
        T = q.shape[0]
        if gather:
            q, w, req, pos = (col.all_gather_tiled(x, gather) for x in (q, w, req, pos))
        r = jax.lax.axis_index(ctx)
        lim = cp.dcp_causal_limit(pos, r, par.dcp, inter, g.tokens_per_page)
        loc, _, score = indexer_topk(q, w, arena, bt, req, lim, lyr, layout=g, component="indexer", topk=topk,
                                     return_scores=True)
        glob = cp.dcp_global_positions(loc, r, par.dcp, inter, g.tokens_per_page)
        idx, _ = col.global_topk_merge(score, glob, ctx)
        if gather:
            idx = jax.lax.dynamic_slice_in_dim(idx, jax.lax.axis_index(gather) * T, T, axis=0)
        return idx

    f = _shard_map(par, body, (s["arena"], s["tok3"], s["tok2"], s["bt"], s["tok"], s["tok"], s["rep"]), s["tok2"])
    return f(kv_arena, q_TID, w_TI, batch.block_tables[group], batch.req_idx_T, batch.positions_T, layer)


# ---------------------------------------------------------------------- sparse MLA
def sparse_attention(q_abs_TNC: jax.Array, kv_arena: jax.Array, topk_TK: jax.Array, batch: ForwardBatch,
                     layout: KVCacheLayout, group: str, layer, *, kv_lora_rank: int, scale: float,
                     parallel: ParallelLayout | None = None, slots_TK: jax.Array | None = None) -> jax.Array:
    """Absorbed sparse MLA over the selected positions → `o_lat [T, N, A]` fp32.

    slots_TK: the positions already resolved to arena slots (HiSparse: `resolve_hot`); by default
    they are looked up in the block tables."""
    g = layout.group(group)
    tpp = g.tokens_per_page
    mode = _kv_mode(parallel)
    attend = partial(sparse_mla, component="mla", kv_lora_rank=kv_lora_rank, scale=scale)
    if mode == "local":
        slots = (positions_to_slots(topk_TK, batch.block_tables[group], batch.req_idx_T, tpp)
                 if slots_TK is None else slots_TK)
        o, _ = attend(q_abs_TNC, kv_arena, slots, layer, layout=g)
        return o
    par = parallel
    budget = copy_budget_rows(batch.block_tables[group].shape, g, par)
    if slots_TK is not None:
        return _attend_resolved(q_abs_TNC, kv_arena, slots_TK, g, layer, attend, par, budget)
    s = _specs(par)
    inter = par.config.dcp_kv_cache_interleave_size
    gather, split = _dcp_axes(par)
    tpp_view = tpp * _split_size(par, gather)
    chunk = max(1, budget // tpp_view)  # pages per chunk of the step-pages copy

    def body(arena, q, topk, bt, req, lyr):
        if mode == "replicated":
            o, _ = attend(q, arena, positions_to_slots(topk, bt, req, tpp), lyr, layout=g)
            return o
        if gather:
            # DCP over PCP: exchange the selected rows each rank owns, or copy the step's pages,
            # whichever moves fewer rows for this step (decided on the device).
            req_all = col.all_gather_tiled(req, gather)  # the table rows of the replica's tokens
            step_pages = _step_pages(bt, req_all)
            selected = q.shape[0] * _split_size(par, gather) * topk.shape[1]
            copied = (step_pages[2] + chunk - 1) // chunk * chunk * tpp_view  # whole chunks are copied
            o, lse = jax.lax.cond(
                reads_selected_rows(copied, selected),
                lambda: _selected_rows_partials(arena, q, _owned_slots(topk, bt, req_all, g, par), lyr, g, attend,
                                                par, budget),
                lambda: _attend_step_pages(q, arena, topk, bt, req, lyr, g, attend, par, chunk, step_pages,
                                           kv_lora_rank))
        else:  # DCP over TP, queries to KV: every head over this rank's shard
            loc = cp.dcp_local_positions(topk, jax.lax.axis_index(split), par.dcp, inter, tpp)
            o, lse = attend(col.all_gather_tiled(q, split, axis=1), arena, positions_to_slots(loc, bt, req, tpp), lyr,
                            layout=g)
        if split:  # (o, lse) partials merged per head over the DCP ranks that split the KV
            o, _ = col.merge_partials(o, lse, split, par.config.dcp_comm_backend)
        return o

    f = _shard_map(par, body, (s["arena"], s["heads3"], s["tok2"], s["bt"], s["tok"], s["rep"]), s["heads3"])
    return f(kv_arena, q_abs_TNC, topk_TK, batch.block_tables[group], batch.req_idx_T, layer)


def _attend_resolved(q_abs_TNC, kv_arena, slots_TK, g: GroupLayout, layer, attend, par: ParallelLayout,
                     budget_rows: int):
    """Sparse MLA over slots resolved per KV shard by `resolve_hot` under a parallel layout.

    `slots_TK` is `[shards · T_replica, K]` (`hot_slot_spec`): each (replica, DCP rank) shard's
    arena slots for every token of its replica, −1 where the shard does not own the position.
    Without DCP the shard's own tokens attend its complete cache. DCP over TP: every head over the
    shard's slots, `(o, lse)` merged over the ranks. DCP over PCP (or TP × PCP): each rank gathers
    the rows of the replica's selections it owns and a reduce-scatter over the PCP ranks gives
    every rank the selected rows of its own queries (each row comes from exactly one rank, the
    others add zeros), attended as a temporary one-page-per-query arena, a block of queries at a
    time within `budget_rows` (`_selected_rows_partials`); with a TP part left, the partials are
    merged over it as above."""
    s = _specs(par)
    gather, split = _dcp_axes(par)
    pcp_axes = ("pcp",) if par.pcp > 1 else ()

    def body(arena, q, slots, lyr):
        T = q.shape[0]
        if not gather:
            if pcp_axes:  # the shard's slots cover the replica's tokens: keep this rank's own
                slots = jax.lax.dynamic_slice_in_dim(slots, jax.lax.axis_index(pcp_axes) * T, T, axis=0)
            if not split:
                o, _ = attend(q, arena, slots, lyr, layout=g)
                return o
            o, lse = attend(col.all_gather_tiled(q, split, axis=1), arena, slots, lyr, layout=g)
            o, _ = col.merge_partials(o, lse, split, par.config.dcp_comm_backend)
            return o
        o, lse = _selected_rows_partials(arena, q, slots, lyr, g, attend, par, budget_rows)
        if split:
            o, _ = col.merge_partials(o, lse, split, par.config.dcp_comm_backend)
        return o

    f = _shard_map(par, body, (s["arena"], s["heads3"], hot_slot_spec(par), s["rep"]), s["heads3"])
    return f(kv_arena, q_abs_TNC, slots_TK, layer)


# ---------------------------------------------------------------------- HiSparse hot buffer
def kv_shard_axes(par: ParallelLayout) -> tuple[str, ...]:
    """Mesh axes that hold distinct KV (and so distinct HiSparse host pools and hot state): the
    DP replicas, then the DCP ranks (the arena's shard order: replica-major)."""
    return par.axes(KV_REPLICA, KV_CONTEXT)


def host_split_axes(par: ParallelLayout) -> tuple[str, ...]:
    """Mesh axes (size > 1) whose devices hold the same KV — TP or PCP ranks outside DCP. A
    HiSparse host pool's columns are split over them, so a replica (or DCP shard) keeps one host
    copy of its rows however many devices read it."""
    shard = kv_shard_axes(par)
    return tuple(a for a in AXES if a not in shard and par.mesh.shape[a] > 1)


def num_kv_shards(par: ParallelLayout) -> int:
    """KV shards of the layout: replicas × DCP ranks (`kv_shard_axes`)."""
    return _split_size(par, kv_shard_axes(par))


def num_host_parts(par: ParallelLayout) -> int:
    """Column parts of a HiSparse host pool: the devices holding the same KV (`host_split_axes`)."""
    return _split_size(par, host_split_axes(par))


def host_pool_spec(par: ParallelLayout) -> PartitionSpec:
    """Partition of the global host pool `uint32[shards · rows, parts · L · Wp]`: rows over the
    KV shards (`kv_shard_axes`), columns over `host_split_axes`."""
    split = host_split_axes(par)
    return PartitionSpec(kv_shard_axes(par), split if split else None)


def hot_state_spec(par: ParallelLayout) -> PartitionSpec:
    """Partition of the hot state `[shards · max_num_seqs, G, M]`: one block of state rows per KV
    shard (replicated, and computed identically, over `host_split_axes`)."""
    return PartitionSpec(kv_shard_axes(par), None, None)


def hot_slot_spec(par: ParallelLayout) -> PartitionSpec:
    """Partition of resolved slots `[shards · T_replica, K]` (see `_attend_resolved`)."""
    return PartitionSpec(kv_shard_axes(par), None)


def _resolve_rows(topk_TK, req_idx_T, bt, hb, row_S, rank_S, tpp: int, narrow_rows: int | None, sort_by_host_row: bool):
    """The resolver over one shard (or the one device): `(slots, miss_rows, miss_slots, stats [3],
    row_S, rank_S)`; skipped (plain block-table lookup) when `hb.active` is False. With
    `sort_by_host_row` the miss list comes in host-row order (`kernels.host_rows.sort_misses`)."""
    N = topk_TK.shape[0] * topk_TK.shape[1]
    M = row_S.shape[1]

    def resolve_width(m):
        """The resolver over the first m hot slots (every lease of the step fits them)."""
        def run(_):
            slots, mr, ms, st, r, k = hot_resolve(
                topk_TK, req_idx_T, bt, hb.host_table_BP, hb.hot_table_BH[:, :m // tpp], hb.state_row_B,
                jnp.minimum(hb.reset_from_B, m), row_S[:, :m], rank_S[:, :m], hb.num_host_blocks,
                tokens_per_page=tpp)
            if sort_by_host_row:
                # Misses in host-row order: adjacent rows (neighbouring positions of a page)
                # become consecutive entries, which the memory-kind copy reads with one host
                # slice per run piece. (A callback chunk is one transfer in any order: unsorted.)
                mr, ms = sort_misses(mr, ms)
            # (dynamic_update_slice, not `.at[:, :m].set`: that scatter inside a cond inside a
            # shard_map crashes XLA:CPU's compiler in jax 0.11.2.)
            return (slots, mr, ms, st, jax.lax.dynamic_update_slice(row_S, r, (0, 0)),
                    jax.lax.dynamic_update_slice(rank_S, k, (0, 0)))
        return run

    narrow = min(M, narrow_rows or M)

    def skip(_):
        none = jnp.full((N,), -1, jnp.int32)
        return (positions_to_slots(topk_TK, bt, req_idx_T, tpp), none, none, jnp.zeros(3, jnp.int32), row_S, rank_S)

    # Decode steps lease at most `narrow` rows: resolving over that width only (not the prefill
    # leases' width) keeps the per-step work proportional to what is leased. (One switch rather
    # than a cond inside a cond: one conditional, and its operand copies, in the program.)
    if narrow == M:
        return jax.lax.cond(hb.active, resolve_width(M), skip, None)
    branch = jnp.where(hb.active, jnp.where(hb.narrow, 1, 2), 0)
    return jax.lax.switch(branch, (skip, resolve_width(narrow), resolve_width(M)), None)


def _record_drops(first_drop_S, num_dropped, topk_TK, slots_TK, req_idx_T, positions_T, bt, hb, tpp: int):
    """`first_drop_S` [S] lowered, at each batch row's state row, to the smallest position of its
    query rows with a dropped selection (`kernels.hot_resolve.dropped_selections`). Only computed
    when the resolver reported drops (`num_dropped` > 0; its stats are 0 when it was skipped)."""
    S = first_drop_S.shape[0]

    def record(drop_S):
        dropped_T = jnp.any(dropped_selections(topk_TK, req_idx_T, bt, hb.host_table_BP, hb.state_row_B, S,
                                               hb.num_host_blocks, slots_TK, tokens_per_page=tpp), axis=1)
        pos_T = jnp.where(dropped_T, positions_T.astype(jnp.int32), NO_DROP)
        first_B = jnp.full(hb.state_row_B.shape[0], NO_DROP, jnp.int32).at[req_idx_T].min(pos_T, mode="drop")
        srow = hb.state_row_B.astype(jnp.int32)
        srow = jnp.where((srow >= 0) & (srow < S), srow, S)
        return drop_S.at[srow].min(first_B, mode="drop")

    return jax.lax.cond(num_dropped > 0, record, lambda d: d, first_drop_S)


HOST_COPY_CHUNK = 1024  # missed rows per all-gather when a host pool's columns are split


def _copy_split_rows(arena, pool, miss_rows, miss_slots, g: GroupLayout, first_layer, num_layers: int,
                     split: tuple[str, ...], num_parts: int, mechanism: str):
    """Missed rows from a pool whose columns are split over `split` (memory_kind): each device
    reads its part of the same rows, chunk by chunk; the parts are all-gathered and joined."""
    _, comp = g.component("mla")
    W = comp.row_words
    wp = split_words(W, num_parts)
    X = miss_rows.shape[0]
    C = min(HOST_COPY_CHUNK, X)
    pad = (-X) % C
    rows_p = jnp.pad(miss_rows, (0, pad), constant_values=-1)
    slots_p = jnp.pad(miss_slots, (0, pad), constant_values=-1)
    n = jnp.sum(miss_rows >= 0).astype(jnp.int32)

    def chunk(c, a):
        r = jax.lax.dynamic_slice(rows_p, (c * C,), (C,))
        sl = jax.lax.dynamic_slice(slots_p, (c * C,), (C,))
        part = read_host_rows(pool, r, jnp.asarray(first_layer, jnp.int32) * wp, num_layers * wp, C,
                              mechanism=mechanism)
        rows = join_column_parts(jax.lax.all_gather(part, split, axis=0, tiled=False).reshape(num_parts, C, -1),
                                 num_layers, W)
        return scatter_host_rows(a, sl, rows, g, "mla", first_layer, num_layers)

    return jax.lax.fori_loop(0, (n + C - 1) // C, chunk, arena)


def _resolve_parallel(topk_TK, kv: PagedKV, batch: ForwardBatch, g: GroupLayout, first_layer, num_layers: int,
                      index_group, host: HostAccess, par: ParallelLayout):
    """`resolve_hot` under a parallel layout: one shard_map in which every KV shard (replica ×
    DCP rank) resolves, with its own hot state and host pool, the positions it owns among the
    whole replica's top-k (all-gathered over PCP): DCP ranks convert the merged global top-k to
    their local positions (others −1), so each rank's hot buffer only ever holds its own rows.
    Devices holding the same KV (TP, or PCP without DCP) resolve identically and read their
    column part of the missed rows (`host_split_axes`)."""
    s = _specs(par)
    tpp = g.tokens_per_page
    hb = batch.hot
    shard_axes = kv_shard_axes(par)
    ctx_axes = par.axes(KV_CONTEXT)
    split = host_split_axes(par)
    R = _split_size(par, split)
    pcp_axes = ("pcp",) if par.pcp > 1 else ()
    n_dcp, inter = par.dcp, par.config.dcp_kv_cache_interleave_size
    callback = host.mechanism == "callback"
    store = host.pool if callback else None
    hot: HotState = kv.hot
    req_spec = par.spec(REQUESTS)
    bt_spec = s["bt"]

    record = hot.first_drop_S is not None

    def body(arena, pool, topk, req, pos, bt, htab, hottab, srow, reset, row_SGM, rank_SGM, active, nhb, narrow, lyr,
             ig):
        topk = col.all_gather_tiled(topk, pcp_axes)
        req = col.all_gather_tiled(req, pcp_axes)
        pos = col.all_gather_tiled(pos, pcp_axes)
        if ctx_axes:
            topk = cp.dcp_local_positions(topk, jax.lax.axis_index(ctx_axes), n_dcp, inter, tpp)
        hbl = dataclasses.replace(hb, host_table_BP=htab, hot_table_BH=hottab, state_row_B=srow, reset_from_B=reset,
                                  active=active, num_host_blocks=nhb, narrow=narrow)
        row_S = jax.lax.dynamic_index_in_dim(row_SGM, ig, axis=1, keepdims=False)
        rank_S = jax.lax.dynamic_index_in_dim(rank_SGM, ig, axis=1, keepdims=False)
        slots, miss_rows, miss_slots, stats, row_S, rank_S = _resolve_rows(topk, req, bt, hbl, row_S, rank_S, tpp,
                                                                           host.narrow_rows, not callback)
        if callback:
            shard = jax.lax.axis_index(shard_axes)
            per_shard = store.shape[0] // num_kv_shards(par)
            arena = copy_host_rows(arena, store, miss_rows, miss_slots, g, "mla", lyr, num_layers,
                                   mechanism="callback", after=pool, row_offset=shard * per_shard)
        elif R == 1:
            arena = copy_host_rows(arena, pool, miss_rows, miss_slots, g, "mla", lyr, num_layers,
                                   mechanism=host.mechanism)
        else:
            arena = _copy_split_rows(arena, pool, miss_rows, miss_slots, g, lyr, num_layers, split, R,
                                     host.mechanism)
        row_SGM = jax.lax.dynamic_update_index_in_dim(row_SGM, row_S, ig, axis=1)
        rank_SGM = jax.lax.dynamic_update_index_in_dim(rank_SGM, rank_S, ig, axis=1)
        mech = "callback" if callback else host.mechanism
        moved = rows_moved(miss_rows, mech)  # per shard, padding included
        # Per shard, gathered (replicated, so a multi-process leader reads every shard locally):
        # the host sums them in 64-bit; a psum in int32 could wrap on wide layouts.
        reads = host_reads(miss_rows, mech)
        stats = col.all_gather_tiled(jnp.concatenate([stats, moved[None] * num_layers, reads[None]])[None],
                                     shard_axes)
        drop = jnp.zeros((0,), jnp.int32)
        if record:  # this shard's state rows, gathered shard-major over the KV shards (replicated)
            local = _record_drops(jnp.full(row_SGM.shape[0], NO_DROP, jnp.int32), jnp.max(stats[:, 2]), topk, slots,
                                  req, pos,
                                  bt, hbl, tpp)
            drop = col.all_gather_tiled(local, shard_axes)
        return slots, arena, row_SGM, rank_SGM, stats, drop

    st_spec = hot_state_spec(par)
    rep = s["rep"]
    # Callback: the pool is the numpy store (static); its argument slot carries `host.after`,
    # the value the reads are ordered after.
    pool_arg = (jnp.int32(0) if host.after is None else host.after) if callback else host.pool
    pool_spec = rep if callback else host_pool_spec(par)
    f = _shard_map(par, body,
                   (s["arena"], pool_spec, s["tok2"], s["tok"], s["tok"], bt_spec, bt_spec, bt_spec, req_spec,
                    req_spec, st_spec, st_spec, rep, rep, rep, rep, rep),
                   (hot_slot_spec(par), s["arena"], st_spec, st_spec, rep, rep))
    slots, arena, row_SGM, rank_SGM, stats, drop = f(
        kv.arena, pool_arg, topk_TK, batch.req_idx_T, batch.positions_T, batch.block_tables[g.name],
        hb.host_table_BP, hb.hot_table_BH, hb.state_row_B, hb.reset_from_B, hot.host_row_SGM, hot.rank_SGM,
        hb.active, hb.num_host_blocks, hb.narrow, first_layer, index_group)
    drop = jnp.minimum(hot.first_drop_S, drop) if record else None
    return slots, PagedKV(arena, HotState(row_SGM, rank_SGM, hot.stats_Z5 + stats, drop))


def resolve_hot(topk_TK: jax.Array, kv: PagedKV, batch: ForwardBatch, layout: KVCacheLayout, group: str,
                first_layer, num_layers: int, index_group, host: HostAccess,
                parallel: ParallelLayout | None = None) -> tuple[jax.Array, PagedKV]:
    """HiSparse: resolve one IndexShare group's top-k to arena slots and fill its hot rows.

    Resident positions map to their page slot; positions of pages that are only in the host pool
    go through the request's hot buffer (`kernels.hot_resolve`, index group `index_group` of
    `kv.hot`): hits reuse their hot slot, misses take the least recently used one and their host
    row's words for the group's layers `[first_layer, first_layer + num_layers)` are copied into
    it (`kernels.host_rows.copy_host_rows`), so the group's shared layers read the same slots
    without a copy of their own. When `batch.hot.active` is False the resolver is skipped
    (`positions_to_slots`, exactly the non-HiSparse read) and no host row is read.

    Returns `(slots [T, K] int32, kv)` with the arena and hot state updated and this group's
    `[hits, misses, dropped, layer rows moved, host reads]` added to `kv.hot.stats_Z5` (one row per
    KV shard; layer rows moved = `kernels.host_rows.rows_moved` · num_layers: the missed rows for
    the memory-kind copies, whole callback chunks with their padding for the callback path; host
    reads = `kernels.host_rows.host_reads`: host slices of the runs, or callbacks). Under a
    parallel layout (`_resolve_parallel`) the slots are per KV shard,
    `[shards · T_replica, K]` (`hot_slot_spec`), and `sparse_attention` takes them as they are.
    """
    g = layout.group(group)
    if _kv_mode(parallel) != "local":
        return _resolve_parallel(topk_TK, kv, batch, g, first_layer, num_layers, index_group, host, parallel)
    tpp = g.tokens_per_page
    hb = batch.hot
    bt = batch.block_tables[group]
    hot: HotState = kv.hot
    row_S = jax.lax.dynamic_index_in_dim(hot.host_row_SGM, index_group, axis=1, keepdims=False)
    rank_S = jax.lax.dynamic_index_in_dim(hot.rank_SGM, index_group, axis=1, keepdims=False)
    slots, miss_rows, miss_slots, stats, row_S, rank_S = _resolve_rows(topk_TK, batch.req_idx_T, bt, hb, row_S,
                                                                       rank_S, tpp, host.narrow_rows,
                                                                       host.mechanism == "memory_kind")
    # Outside the cond: the host pool is only ever read by the copy loop (zero trips when skipped).
    arena = copy_host_rows(kv.arena, host.pool, miss_rows, miss_slots, g, "mla", first_layer, num_layers,
                           mechanism=host.mechanism, after=host.after)
    drop = hot.first_drop_S
    if drop is not None:
        drop = _record_drops(drop, stats[2], topk_TK, slots, batch.req_idx_T, batch.positions_T, bt, hb, tpp)
    hot = HotState(jax.lax.dynamic_update_index_in_dim(hot.host_row_SGM, row_S, index_group, axis=1),
                   jax.lax.dynamic_update_index_in_dim(hot.rank_SGM, rank_S, index_group, axis=1),
                   hot.stats_Z5 + jnp.concatenate([stats, rows_moved(miss_rows, host.mechanism)[None] * num_layers,
                                                    host_reads(miss_rows, host.mechanism)[None]])[None],
                   drop)
    return slots, PagedKV(arena, hot)


def store_host_pages(pool, kv_arena: jax.Array, src_RC: jax.Array, dst_RC: jax.Array, layout: KVCacheLayout,
                     group: str, *, mechanism: str, parallel: ParallelLayout | None = None):
    """HiSparse's write-through copies: host block `dst[i]` ← arena page `src[i]` (every layer of
    the group, token-major; `kernels.host_rows.store_pages`).

    On one device `src_RC`/`dst_RC` are `[C]`. Under a parallel layout they are `[dp, C]`
    (replica r's list, engine block ids), and every KV shard of replica r stores its own share
    of each page into its own part of the pool; devices that hold the same KV each store their
    column part (memory_kind), or only the first of them writes the shared store (callback).
    Returns `(pool, done)` as `store_pages`."""
    g = layout.group(group)
    if _kv_mode(parallel) == "local":
        return store_pages(pool, kv_arena, src_RC, dst_RC, g, group, mechanism=mechanism)
    par = parallel
    s = _specs(par)
    shard_axes = kv_shard_axes(par)
    split = host_split_axes(par)
    R = _split_size(par, split)
    lists = par.spec(KV_REPLICA, None)
    if mechanism == "callback":
        store = pool
        per_shard = store.shape[0] // num_kv_shards(par)

        def body_cb(arena, src, dst):
            first = jax.lax.axis_index(split) == 0 if split else True
            _, done = store_pages(store, arena, src[0], dst[0], g, group, mechanism="callback",
                                  row_offset=jax.lax.axis_index(shard_axes) * per_shard, enabled=first)
            return done

        f = _shard_map(par, body_cb, (s["arena"], lists, lists), s["rep"])
        return pool, f(kv_arena, src_RC, dst_RC)

    def body(p, arena, src, dst):
        part = jax.lax.axis_index(split) if split else 0
        return store_pages(p, arena, src[0], dst[0], g, group, mechanism=mechanism, num_parts=R, part=part)

    f = _shard_map(par, body, (host_pool_spec(par), s["arena"], lists, lists), (host_pool_spec(par), s["rep"]))
    return f(pool, kv_arena, src_RC, dst_RC)


def engine_tokens_per_page(layout: KVCacheLayout, group: str, parallel: ParallelLayout | None = None) -> int:
    """Tokens one engine page of `group` spans: the group's tokens_per_page × the DCP size."""
    n = parallel.dcp if parallel is not None else 1
    return layout.group(group).tokens_per_page * n

