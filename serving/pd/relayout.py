"""Re-layout of one request's KV between arena page layouts (host-side numpy).

A prefill engine and a decode engine may lay the same KV out differently: another DCP size N
(an engine page of a group spans `g · N` tokens, token t on rank `(t // I) % N`, I the interleave
size: `sharding/context_parallel.py`), another interleave, another set of pages. What they share
is the model's *row format*: the group layouts' components (widths, row dtypes, layer counts),
which depend only on the model and the cache dtype. The transfer therefore carries each group's
KV in a layout-free **canonical form**, `uint32[num_tokens, words_per_token]`: row t holds token
t's record of every layer of the group, component by component, layer by layer, each row's
segments concatenated in order (the "logical row" of `kernels/paged/layout.py`). It is the same
bytes the pages hold, only rearranged, so a round trip is exact for every row dtype (fp32, bf16,
`fp8_ds_mla`, fp8 indexer keys with their scale segment).

`pages_to_canonical` reads a request's pages of one group (each DCP rank's shard) into the
canonical form; `canonical_to_pages` builds the destination's page contents for its own DCP size,
interleave and page count. Word offsets follow `kernels/paged/layout.py`: inside a page,
component-major, then layer, then segment, then token.
"""

from __future__ import annotations

import numpy as np

from kernels.paged.layout import GroupLayout
from sharding.context_parallel import dcp_global_positions, dcp_local_positions


def words_per_token(group: GroupLayout) -> int:
    """uint32 words of one token's canonical row in `group` (all components and layers)."""
    return sum(c.num_layers * c.row_words for c in group.components)


def _regions(group: GroupLayout):
    """(page word offset, canonical column, segment words) of every (component, layer, segment)
    region of a page: each region holds `tokens_per_page` rows of `segment words` words."""
    g = group.tokens_per_page
    base = col = 0
    for c in group.components:
        rw = c.row_words
        for layer in range(c.num_layers):
            seg_off = 0
            for sw in c.segments:
                yield base + layer * g * rw + g * seg_off, col + layer * rw + seg_off, sw
                seg_off += sw
        base += c.num_layers * g * rw
        col += c.num_layers * rw


def pages_to_rows(pages: np.ndarray, group: GroupLayout) -> np.ndarray:
    """Rows of the tokens held by `pages` (`uint32[P, page_words]`, one rank's pages in table
    order) → `uint32[P · tokens_per_page, words_per_token]` in local position order."""
    P, g = pages.shape[0], group.tokens_per_page
    rows = np.empty((P, g, words_per_token(group)), np.uint32)
    for off, col, sw in _regions(group):
        rows[:, :, col:col + sw] = pages[:, off:off + g * sw].reshape(P, g, sw)
    return rows.reshape(P * g, -1)


def rows_to_pages(rows: np.ndarray, group: GroupLayout, page_words: int) -> np.ndarray:
    """Inverse of `pages_to_rows`: `uint32[P · tokens_per_page, words_per_token]` → page contents
    `uint32[P, page_words]` (words past the group's own region are zero)."""
    g = group.tokens_per_page
    P = rows.shape[0] // g
    r = rows.reshape(P, g, -1)
    pages = np.zeros((P, page_words), np.uint32)
    for off, col, sw in _regions(group):
        pages[:, off:off + g * sw] = r[:, :, col:col + sw].reshape(P, g * sw)
    return pages


def pages_to_canonical(shard_pages: list[np.ndarray], group: GroupLayout, num_tokens: int,
                       dcp: int = 1, interleave: int = 1, first_page: int = 0) -> np.ndarray:
    """`num_tokens` tokens of `group` in canonical form, from the start of engine page `first_page`.

    shard_pages: per DCP rank (rank order), `uint32[P, page_words]`: the rank's copy of the
        request's engine pages first_page … first_page + P − 1 (block table order).
    Returns `uint32[num_tokens, words_per_token]` (row i: token first_page · g · dcp + i). Raises ValueError when the pages cannot cover
    `num_tokens` tokens or the shard count is not `dcp`.
    """
    if len(shard_pages) != dcp:
        raise ValueError(f"expected {dcp} DCP shards of pages, got {len(shard_pages)}")
    g = group.tokens_per_page
    out = np.empty((num_tokens, words_per_token(group)), np.uint32)
    covered = 0
    for rank, pages in enumerate(shard_pages):
        rows = pages_to_rows(pages, group)
        local = first_page * g + np.arange(rows.shape[0])
        gp = dcp_global_positions(local, rank, dcp, interleave, g) - first_page * g * dcp
        mine = gp < num_tokens
        out[gp[mine]] = rows[mine]
        covered += int(mine.sum())
    if covered != num_tokens:
        raise ValueError(f"group {group.name!r}: the pages cover {covered} of {num_tokens} tokens")
    return out


def canonical_to_pages(rows: np.ndarray, start: int, group: GroupLayout, page_words: int,
                       first_page: int, num_pages: int, dcp: int = 1, interleave: int = 1) -> list[np.ndarray]:
    """Page contents of engine pages `first_page … first_page + num_pages − 1` of `group` for a
    destination with DCP size `dcp` and `interleave`, from canonical rows of tokens
    `start … start + len(rows) − 1`.

    Every token of those pages below `start + len(rows)` must be in `rows` (the pages start at or
    after `start`); tokens past the end are left zero (a later step writes them).
    Returns per DCP rank `uint32[num_pages, page_words]`. Raises ValueError when the first page
    starts before `start`.
    """
    g = group.tokens_per_page
    span = g * dcp  # tokens of one engine page
    if first_page * span < start:
        raise ValueError(f"group {group.name!r}: page {first_page} starts at token {first_page * span}, before the "
                         f"transferred rows (from {start})")
    end = start + rows.shape[0]
    pos = np.arange(first_page * span, min(end, (first_page + num_pages) * span))
    out = []
    for rank in range(dcp):
        local = dcp_local_positions(pos, rank, dcp, interleave, g)
        mine = local >= 0
        shard = np.zeros((num_pages * g, rows.shape[1]), np.uint32)
        shard[local[mine] - first_page * g] = rows[pos[mine] - start]
        out.append(rows_to_pages(shard, group, page_words))
    return out
