"""The device side of the offloading connector: the host page store array and its two programs.

`OffloadTransfer.host` is `uint32[num_host_blocks, page_words]`: a `pinned_host` `jax.Array`
("memory_kind") or a numpy `HostRowStore` ("callback"), chosen like HiSparse's
(`kernels.host_rows.default_mechanism`). `store` (host ← arena pages) and `load` (arena ← host
pages) are jitted programs of their own, dispatched by the model runner before the step, stores
first (`kernels.host_rows.store_arena_pages` / `load_arena_pages`). Their index lists are −1
padded to a power of two (at most `max_ops`), so each program compiles for a few shapes only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels.host_rows import load_arena_pages, store_arena_pages
from serving.hisparse.device_state import make_host_pool


def _bucket(n: int, cap: int) -> int:
    b = 8
    while b < n:
        b *= 2
    return min(b, max(cap, 8))


class OffloadTransfer:
    """Host page store + store/load programs.

    Args:
      num_host_blocks: host blocks including the null block. page_words: uint32 words per page.
      mechanism: "memory_kind" or "callback". max_ops: most pages one program moves (longer
        lists are split over several calls).
    """

    def __init__(self, num_host_blocks: int, page_words: int, mechanism: str, max_ops: int = 1024):
        self.mechanism = mechanism
        self.max_ops = int(max_ops)
        self.page_words = int(page_words)
        self.host = make_host_pool(mechanism, num_host_blocks, page_words)
        self._done = None

        @functools.partial(jax.jit, donate_argnums=(0,) if mechanism == "memory_kind" else ())
        def store(host, arena, src, dst):
            return store_arena_pages(host, arena, src, dst, mechanism=mechanism)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def load(arena, host, src, dst):
            return load_arena_pages(arena, host, src, dst, mechanism=mechanism)

        self._store, self._load = store, load

    def _lists(self, pairs):
        for i in range(0, len(pairs), self.max_ops):
            chunk = pairs[i:i + self.max_ops]
            n = _bucket(len(chunk), self.max_ops)
            src = np.full(n, -1, np.int32)
            dst = np.full(n, -1, np.int32)
            if chunk:
                src[:len(chunk)], dst[:len(chunk)] = np.asarray(chunk, np.int32).T
            yield jnp.asarray(src), jnp.asarray(dst)

    def store(self, arena: jax.Array, pairs) -> None:
        """Host block ← arena page for each `(device_block, host_block)` of `pairs`."""
        for src, dst in self._lists(pairs):
            self.host, self._done = self._store(self.host, arena, src, dst)

    def load(self, arena: jax.Array, pairs) -> jax.Array:
        """Arena page ← host block for each `(host_block, device_block)` of `pairs`; returns the
        arena (the input is donated)."""
        for src, dst in self._lists(pairs):
            arena = self._load(arena, self.host, src, dst)
        return arena

    def wait(self) -> None:
        """Block until the dispatched stores ran (an idle engine flushing its queue)."""
        if self._done is not None:
            jax.block_until_ready(self._done)
