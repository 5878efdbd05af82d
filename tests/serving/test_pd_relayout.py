"""Canonical-row re-layout of serving/pd/relayout.py against a token-by-token reference written
from the formulas of kernels/paged/layout.py (word offsets) and sharding/context_parallel.py
(DCP ownership), for every row dtype and DCP N → M with other interleaves."""

from __future__ import annotations

import numpy as np
import pytest

from glm53.config import preset
from glm53.kv_layout import build_kv_layout
from serving.pd.relayout import canonical_to_pages, pages_to_canonical


def owner_and_row(t: int, g: int, n: int, interleave: int) -> tuple[int, int, int]:
    """(engine page, DCP rank, row inside the rank's page) of token t (context_parallel docstring)."""
    page, o = t // (g * n), t % (g * n)
    return page, (o // interleave) % n, (o // (interleave * n)) * interleave + o % interleave


def token_words(pages_by_rank, group, t, n, interleave, blocks):
    """Every word of token t in `group`, read one (component, layer, segment) at a time."""
    g = group.tokens_per_page
    page, rank, row = owner_and_row(t, g, n, interleave)
    out, base = [], 0
    for c in group.components:
        for layer in range(c.num_layers):
            seg_off = 0
            for sw in c.segments:
                off = base + layer * g * c.row_words + g * seg_off + row * sw
                out.append(pages_by_rank[rank][blocks[page], off:off + sw])
                seg_off += sw
        base += c.num_layers * g * c.row_words
    return np.concatenate(out)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("src,dst", [((1, 1), (2, 1)), ((2, 1), (1, 1)), ((2, 1), (2, 4)), ((4, 2), (2, 1))])
def test_relayout_matches_token_by_token_reference(cache_dtype, src, dst):
    layout = build_kv_layout(preset("tiny"), cache_dtype, with_mtp=True)
    rng = np.random.default_rng(0)
    (n, i_src), (m, i_dst) = src, dst
    num_tokens = 1700  # more than one indexer page (768 tokens) even at DCP 2
    for group in layout.groups:
        g = group.tokens_per_page
        src_pages = -(-num_tokens // (g * n))
        blocks = rng.permutation(np.arange(1, src_pages + 9))[:src_pages]  # scattered pages
        arenas = [rng.integers(0, 2**32, (src_pages + 9, layout.page_words), dtype=np.uint32) for _ in range(n)]
        canon = pages_to_canonical([a[blocks] for a in arenas], group, num_tokens, n, i_src)
        for t in (0, 1, g - 1, g, num_tokens // 2, num_tokens - 1):
            assert np.array_equal(canon[t], token_words(arenas, group, t, n, i_src, blocks)), (group.name, t)
        # … and into the destination layout, from a start that is a destination page boundary.
        start = g * m if num_tokens > 2 * g * m else 0
        dst_pages = -(-num_tokens // (g * m)) - start // (g * m)
        shards = canonical_to_pages(canon[start:], start, group, layout.page_words, start // (g * m), dst_pages,
                                    m, i_dst)
        dst_blocks = np.arange(start // (g * m) + dst_pages) - start // (g * m)  # engine page p → row p - first
        for t in range(start, num_tokens, 97):
            want = token_words(arenas, group, t, n, i_src, blocks)
            got = token_words(shards, group, t, m, i_dst, dst_blocks)
            assert np.array_equal(got, want), (group.name, t)


def test_canonical_refuses_pages_that_do_not_cover_the_tokens():
    layout = build_kv_layout(preset("tiny"), "float32", with_mtp=False)
    g = layout.group("mla")
    with pytest.raises(ValueError, match="cover"):
        pages_to_canonical([np.zeros((1, layout.page_words), np.uint32)], g, 100)
