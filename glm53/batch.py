"""The flat per-step inputs of one forward pass over a ragged batch (a jit pytree).

A step holds T query tokens from B requests. Tokens of one request are contiguous and in
position order; padding tokens use `slot_mapping = −1` (writes dropped) and position 0 with a
request row whose block table is all null, so they attend to nothing and affect nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class ForwardBatch:
    """Per-step arrays (all int32).

    input_ids_T: token ids `[T]`.
    positions_T: request-local positions `[T]`.
    req_idx_T: row of the block tables for each token `[T]`.
    slot_mapping: per KV cache group name, the slot each token's new KV row is written to `[T]`
        (−1 = skip).
    block_tables: per group name, `[B, P_g]` block ids (0 = null block).
    logits_indices_B: rows of T whose logits are returned `[B]` (usually each request's last token).
    hot: HiSparse inputs (`glm53.hot_cache.HotBatch`), None when HiSparse is off.
    """

    input_ids_T: jax.Array
    positions_T: jax.Array
    req_idx_T: jax.Array
    slot_mapping: dict
    block_tables: dict
    logits_indices_B: jax.Array
    hot: Any = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids_T.shape[0]


def page_slots(blocks, positions, tokens_per_page: int) -> np.ndarray:
    """Slot ids `blocks[p // tpp] * tpp + p % tpp` of `positions` (int32 `[len(positions)]`),
    computed in 64 bits. Raises ValueError when a slot does not fit int32, the dtype every
    device program indexes the arena with (a 1M-token context under DCP 8 makes engine pages of
    32,768 tokens: block ids past 65,535 would wrap)."""
    b = np.asarray(blocks, np.int64)
    p = np.asarray(positions, np.int64)
    slots = b[p // tokens_per_page] * tokens_per_page + p % tokens_per_page
    if slots.size and int(slots.max()) > np.iinfo(np.int32).max:
        raise ValueError(f"slot id {int(slots.max())} (block {int(b.max())} × {tokens_per_page} tokens per page) "
                         "does not fit int32")
    return slots.astype(np.int32)


def single_sequence_batch(layout, token_ids, start_pos: int, block_ids: dict, logits_all: bool = True) -> ForwardBatch:
    """A batch for one request whose pages per group are `block_ids[group]` (lists), covering
    positions start_pos .. start_pos+len(token_ids)-1. For notebooks and tests."""
    T = len(token_ids)
    pos = np.arange(start_pos, start_pos + T, dtype=np.int32)
    slot_mapping, block_tables = {}, {}
    for g in layout.groups:
        ids = np.asarray(block_ids[g.name], dtype=np.int32)
        slot_mapping[g.name] = page_slots(block_ids[g.name], pos, g.tokens_per_page)
        block_tables[g.name] = ids[None, :]
    logits = np.arange(T, dtype=np.int32) if logits_all else np.array([T - 1], np.int32)
    return ForwardBatch(
        input_ids_T=np.asarray(token_ids, np.int32),
        positions_T=pos,
        req_idx_T=np.zeros(T, np.int32),
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        logits_indices_B=logits,
    )
