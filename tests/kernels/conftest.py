"""Shared helpers: a tiny paged arena filled from dense per-request arrays."""

import numpy as np
import pytest

from kernels.paged import CacheComponent, GroupLayout


def make_layout(width, num_layers=2, tpp=8, row_dtype="float32", name="g", component="c"):
    return GroupLayout(name, tpp, (CacheComponent(component, num_layers, width, row_dtype),))


def scatter_dense(layout, num_blocks, seqs, layer, rng, component="c"):
    """Allocate shuffled pages (never block 0) for each dense sequence `[S_i, W]`, write them with
    the cache-write op (one jitted program: eagerly each of its ops compiles on its own), and
    return (arena, block_tables [B, P], slots per sequence)."""
    import jax
    import jax.numpy as jnp

    from kernels.paged import write_cache

    write_cache = jax.jit(write_cache, static_argnums=(3, 4, 5))

    tpp = layout.tokens_per_page
    pages = [int(np.ceil(len(s) / tpp)) for s in seqs]
    free = list(rng.permutation(np.arange(1, num_blocks)))
    P = max(pages) + 1
    bt = np.zeros((len(seqs), P), np.int32)
    page_words = sum(c.num_layers * tpp * c.row_words for c in layout.components) + 3  # arena page may be larger
    arena = jnp.asarray(rng.integers(0, 2**32, size=(num_blocks, page_words), dtype=np.uint32))  # garbage
    slots_all = []
    for b, (s, n) in enumerate(zip(seqs, pages)):
        for j in range(n):
            bt[b, j] = free.pop()
        pos = np.arange(len(s))
        slots = bt[b, pos // tpp] * tpp + pos % tpp
        arena = write_cache(arena, jnp.asarray(s), jnp.asarray(slots, jnp.int32), layout, component, layer)
        slots_all.append(slots)
    return arena, bt, slots_all


@pytest.fixture
def rng():
    return np.random.default_rng(0)
