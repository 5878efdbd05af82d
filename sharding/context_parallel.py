"""Index maths of context parallelism: DCP token ownership and PCP load-balanced chunking.

DCP (docs/design.md §7): with N ranks and interleave size I, request-local position p lives on rank
`(p // I) % N`. The engine's block tables name pages of `g · N` tokens (`g` = the group's
tokens_per_page on one device, e.g. 64 for MLA): block b holds, on every rank, the `g` rows of
that rank's share of the page's `g · N` positions, in position order. So for p:

    page = p // (g·N),  o = p % (g·N),  rank = (o // I) % N,
    local row = (o // (I·N)) · I + o % I,          local position = page · g + local row

and the engine slot `block · g·N + o` becomes the rank-local slot `block · g + local row`. Ranks
see their shard as an ordinary paged cache of `g`-token pages indexed by local positions, which
are increasing in p, so the kernels run unchanged on a shard.

PCP (docs/design.md §7; arXiv 2411.01783 load-balanced sharding): a replica's T step tokens are cut into
2N equal chunks and rank g takes chunks g and 2N−1−g, balancing causal work.

All functions work on numpy or jax arrays (integer maths only).
"""

from __future__ import annotations

import numpy as np


def _xp(x):
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np
    import jax.numpy as jnp

    return jnp


def dcp_owner(positions, n: int, interleave: int, tokens_per_page: int):
    """DCP rank holding each position (positions ≥ 0; the page size only matters through `g·N`)."""
    o = positions % (tokens_per_page * n)
    return (o // interleave) % n


def dcp_local_positions(positions, rank, n: int, interleave: int, tokens_per_page: int):
    """Rank-local positions of global positions owned by `rank`; −1 for others and for −1 input."""
    xp = _xp(positions)
    p = xp.maximum(positions, 0)
    G = tokens_per_page * n
    page, o = p // G, p % G
    local = page * tokens_per_page + (o // (interleave * n)) * interleave + o % interleave
    mine = (positions >= 0) & ((o // interleave) % n == rank)
    return xp.where(mine, local, -1)


def dcp_global_positions(local_positions, rank, n: int, interleave: int, tokens_per_page: int):
    """Inverse of `dcp_local_positions` for `rank`; −1 stays −1."""
    xp = _xp(local_positions)
    s = xp.maximum(local_positions, 0)
    page, row = s // tokens_per_page, s % tokens_per_page
    o = (row // interleave) * interleave * n + rank * interleave + row % interleave
    return xp.where(local_positions >= 0, page * tokens_per_page * n + o, -1)


def dcp_causal_limit(positions, rank, n: int, interleave: int, tokens_per_page: int):
    """Largest local position of `rank` whose global position is ≤ `positions` (−1 if none): the
    causal bound a query at that position uses on this rank's shard."""
    xp = _xp(positions)
    p = xp.maximum(positions, 0)
    G = tokens_per_page * n
    page, o = p // G, p % G
    q, rem = o // (interleave * n), o % (interleave * n)
    partial = xp.clip(rem - rank * interleave + 1, 0, interleave)
    count = page * tokens_per_page + q * interleave + partial
    return xp.where(positions >= 0, count - 1, -1)


def dcp_local_slots(slots, rank, n: int, interleave: int, tokens_per_page: int):
    """Engine slots (pages of `g·N` tokens) → this rank's local slots (pages of `g`), −1 where
    another rank owns the token or the input is −1."""
    xp = _xp(slots)
    s = xp.maximum(slots, 0)
    G = tokens_per_page * n
    block, o = s // G, s % G
    local = block * tokens_per_page + (o // (interleave * n)) * interleave + o % interleave
    mine = (slots >= 0) & ((o // interleave) % n == rank)
    return xp.where(mine, local, -1)


def pcp_chunk_order(num_tokens: int, n: int) -> np.ndarray:
    """Load-balanced PCP order: a permutation of range(num_tokens) whose n equal contiguous slices
    are, for rank g, chunks g and 2n−1−g of the 2n equal chunks. Raises ValueError unless 2n
    divides num_tokens."""
    if num_tokens % (2 * n):
        raise ValueError(f"PCP needs the token count ({num_tokens}) to be a multiple of 2 × pcp = {2 * n}")
    c = num_tokens // (2 * n)
    chunks = np.arange(num_tokens).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[g], chunks[2 * n - 1 - g]]) for g in range(n)])


def pcp_placed_rows(num_tokens: int, n: int) -> np.ndarray:
    """The inverse of `pcp_chunk_order`: int64 [num_tokens], the placed row of each token (token t
    sits at row `pcp_placed_rows(...)[t]` of the load-balanced order). Raises as `pcp_chunk_order`."""
    order = pcp_chunk_order(num_tokens, n)
    rows = np.empty_like(order)
    rows[order] = np.arange(len(order))
    return rows
