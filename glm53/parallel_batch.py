"""Step inputs for parallel layouts: per-replica batches, DP stacking, PCP reordering, the arena.

A step under a `ParallelLayout` is one SPMD program over global arrays:

* tokens: the DP replicas' token lists concatenated (`T = dp × T_replica`), split over `TOKENS`
  (dp, then pcp). Under PCP each replica's tokens are in load-balanced order
  (`sharding.context_parallel.pcp_chunk_order`), so PCP rank g holds chunks g and 2N−1−g.
* block tables: the replicas' tables concatenated (`[dp × B, P]`); `req_idx_T` indexes the
  token's own replica's table; `logits_indices_B` are global token rows.
* slot_mapping / block tables use engine pages of `tokens_per_page × dcp` tokens.
* the KV arena: `uint32[dp × dcp × num_blocks, page_words]` (one arena per replica and DCP rank,
  sharded by `sharding.rules.cache_sharding`).
"""

from __future__ import annotations

import jax
import numpy as np

from glm53.batch import ForwardBatch, page_slots
from glm53.hot_cache import HotBatch
from glm53.kv_layout import KVCacheLayout
from sharding.context_parallel import pcp_chunk_order, pcp_placed_rows
from sharding.mesh import REQUESTS, TOKENS, ParallelLayout
from sharding.rules import arena_shards, cache_sharding


def replica_batch(layout: KVCacheLayout, requests, num_tokens: int, num_rows: int, dcp: int = 1,
                  logits_all: bool = False) -> ForwardBatch:
    """One replica's batch of requests, padded to `num_tokens` tokens and `num_rows` request rows.

    Args:
      requests: sequence of `(token_ids, start_pos, block_ids)` where `block_ids[group]` lists the
        request's pages (engine pages of `tokens_per_page × dcp` tokens).
      num_rows: request rows (≥ len(requests) + 1: the last row stays all-null, used by padding
        tokens). Block tables are as wide as the widest request's page list.
      logits_all: logits for every token (else each request's last token).
    Raises ValueError when the requests do not fit, or a slot id does not fit int32
    (`glm53.batch.page_slots`).
    """
    T = sum(len(t) for t, _, _ in requests)
    if T > num_tokens or len(requests) + 1 > num_rows:
        raise ValueError(f"{len(requests)} requests / {T} tokens do not fit {num_rows - 1} rows / {num_tokens} tokens")
    pad_row = num_rows - 1
    ids = np.zeros(num_tokens, np.int32)
    pos = np.zeros(num_tokens, np.int32)
    req = np.full(num_tokens, pad_row, np.int32)
    slots = {g.name: np.full(num_tokens, -1, np.int32) for g in layout.groups}
    width = {g.name: max(len(b[g.name]) for _, _, b in requests) for g in layout.groups}
    tables = {g.name: np.zeros((num_rows, width[g.name]), np.int32) for g in layout.groups}
    logits = []
    off = 0
    for i, (toks, start, blocks) in enumerate(requests):
        n = len(toks)
        p = np.arange(start, start + n, dtype=np.int32)
        ids[off:off + n], pos[off:off + n], req[off:off + n] = toks, p, i
        for g in layout.groups:
            tpp = g.tokens_per_page * dcp
            b = np.asarray(blocks[g.name], np.int32)
            slots[g.name][off:off + n] = page_slots(blocks[g.name], p, tpp)
            tables[g.name][i, :len(b)] = b
        logits.extend(range(off, off + n) if logits_all else [off + n - 1])
        off += n
    return ForwardBatch(ids, pos, req, slots, tables, np.asarray(logits, np.int32))


def pcp_reorder(batch: ForwardBatch, pcp: int) -> ForwardBatch:
    """Put a replica's tokens in PCP load-balanced order (logits_indices follow their tokens)."""
    if pcp == 1:
        return batch
    order = pcp_chunk_order(batch.num_tokens, pcp)
    take = lambda a: np.asarray(a)[order]  # noqa: E731
    return ForwardBatch(take(batch.input_ids_T), take(batch.positions_T), take(batch.req_idx_T),
                        {k: take(v) for k, v in batch.slot_mapping.items()}, dict(batch.block_tables),
                        pcp_placed_rows(batch.num_tokens, pcp)[np.asarray(batch.logits_indices_B)].astype(np.int32),
                        batch.hot)


def stack_replicas(batches: list[ForwardBatch], pcp: int = 1) -> ForwardBatch:
    """DP: concatenate the replicas' (PCP-reordered) batches into one global batch. All replicas
    must have the same token count, rows and table widths."""
    hots = [b.hot for b in batches]
    batches = [pcp_reorder(b, pcp) for b in batches]
    T = batches[0].num_tokens
    cat = lambda xs: np.concatenate([np.asarray(x) for x in xs])  # noqa: E731
    hot = None
    if hots[0] is not None:  # HiSparse: row arrays per replica, one active/narrow flag for the step
        hot = HotBatch(cat([h.host_table_BP for h in hots]), cat([h.hot_table_BH for h in hots]),
                       cat([h.state_row_B for h in hots]), cat([h.reset_from_B for h in hots]),
                       np.bool_(any(bool(h.active) for h in hots)), hots[0].num_host_blocks,
                       np.bool_(all(bool(h.narrow) or not bool(h.active) for h in hots)))
    return ForwardBatch(
        cat([b.input_ids_T for b in batches]), cat([b.positions_T for b in batches]),
        cat([b.req_idx_T for b in batches]),
        {k: cat([b.slot_mapping[k] for b in batches]) for k in batches[0].slot_mapping},
        {k: cat([b.block_tables[k] for b in batches]) for k in batches[0].block_tables},
        cat([np.asarray(b.logits_indices_B) + r * T for r, b in enumerate(batches)]).astype(np.int32), hot)


def batch_shardings(batch: ForwardBatch, parallel: ParallelLayout) -> ForwardBatch:
    """Shardings of a global batch: token arrays over TOKENS, block tables over REQUESTS, logits
    indices replicated."""
    tok, bt = parallel.sharding(TOKENS), parallel.sharding(REQUESTS, None)
    rep = parallel.sharding()
    hot = None
    if batch.hot is not None:  # HiSparse: per-request rows with the block tables, flags replicated
        row = parallel.sharding(REQUESTS)
        hot = HotBatch(bt, bt, row, row, rep, rep, rep)
    return ForwardBatch(tok, tok, tok, {k: tok for k in batch.slot_mapping}, {k: bt for k in batch.block_tables},
                        parallel.sharding(None), hot)


def shard_batch(batch: ForwardBatch, parallel: ParallelLayout) -> ForwardBatch:
    """Place a global batch on the mesh."""
    return jax.device_put(batch, batch_shardings(batch, parallel))


def empty_parallel_arena(layout: KVCacheLayout, num_blocks: int, parallel: ParallelLayout) -> jax.Array:
    """Zeroed global arena `uint32[dp · dcp · num_blocks, page_words]` on its sharding; each
    (replica, DCP rank) shard has `num_blocks` pages with block 0 the null block."""
    import jax.numpy as jnp

    shape = (arena_shards(parallel) * num_blocks, layout.page_words)
    return jax.jit(lambda: jnp.zeros(shape, jnp.uint32), out_shardings=cache_sharding(parallel))()

