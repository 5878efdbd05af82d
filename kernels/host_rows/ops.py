"""Moving KV rows between the paged device arena and a host-memory row pool (HiSparse, docs/design.md §4.3).

Host pool layout. The pool holds whole pages of one single-component group (the MLA latent group:
every sparse-MLA layer of a token), *token-major*: host row r is one token's rows of all L layers
back to back, `uint32[num_host_blocks · tpp, L · W]` (W = row words). Host block b is rows
`[b·tpp, (b+1)·tpp)`; block 0 is the null block (never written, never read). Token-major makes
both transfers contiguous:

* a page copy (device page → host block, the write-through "pre-copy") is one `[tpp, L·W]`
  slab: the arena page `[L, tpp, W]` (layer-major, `kernels/paged/layout.py`) transposed;
* a hot-row copy (host row → a device slot, for the layers `[l0, l0 + n)` of one IndexShare
  group) is one contiguous run of `n · W` words of one host row.

Two mechanisms implement the same contract (`MECHANISMS`; `api.py` chooses per backend):

* "memory_kind": the pool is a `jax.Array` in the `pinned_host` memory kind, threaded through
  the jitted step (donated). Every host access is XLA's supported host-offload pattern: a
  contiguous `dynamic_slice` of the host array immediately moved to device memory
  (`jax.device_put(..., jax.memory.Space.Device)`), or a device value moved to host memory and
  written with `dynamic_update_slice`. No gather, scatter or arithmetic ever reads a host value
  (on a GPU those are rejected or become slow host compute: openxla/xla#34565, #47362,
  jax#34041). A gather sorts its miss list by host row and reads runs of adjacent host rows
  with one slice each (`HOST_RUN_SIZES`: a run of 70 rows is 64 + 4 + 1 + 1, four slices); a
  store is one loop iteration per page; loops run over the valid entries only.
* "callback": the pool is a numpy array owned by a `HostRowStore`; the step gathers and stores
  through `jax.experimental.io_callback` (supported on GPU), in chunks of `CALLBACK_CHUNK` rows
  (a chunk of GLM-5.3's 4-layer group rows is 2.6 MB; a chunk is one transfer whatever its
  rows' order, so runs change nothing there). The callbacks are unordered; a read is
  ordered after the stores through a data dependency: `store_pages` returns an int32 `done`
  computed from the stores' callback results, and the caller passes it to `copy_host_rows` as
  `after` (an operand of every read callback; the serving step takes the last store program's
  value, `serving/runner.py`).

Row copies land in the arena through `scatter_rows` (one call per layer); −1 slots are dropped.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback

from kernels.paged.layout import GroupLayout
from kernels.paged.ops import row_location

MECHANISMS = ("memory_kind", "callback")
CALLBACK_CHUNK = 1024
# Rows one memory-kind host slice moves, largest first: a run of adjacent host rows is read in
# the fewest such slices (greedy), so a run of 64 adjacent missed rows is one host transfer
# instead of 64 (on a GPU each is a host round trip: latency-bound at a few KiB).
HOST_RUN_SIZES = (64, 16, 4, 1)


@jax.tree_util.register_pytree_node_class
class HostRowStore:
    """The host pool of the "callback" mechanism: a numpy array `uint32[rows, row_words]`, read
    and written by host callbacks inside the jitted step. A pytree without leaves (the object
    itself is the static part, hashed by identity), so it passes through `jax.jit` like the
    memory-kind pool's `jax.Array`."""

    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, aux, children):
        return aux

    def __init__(self, num_rows: int, row_words: int):
        self.rows = np.zeros((int(num_rows), int(row_words)), np.uint32)
        self.words_gathered = 0  # uint32 words handed to the device by `_gather`, padding included

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape

    def _gather(self, rows, col_start, num_cols: int, _after):
        rows = np.asarray(rows)
        ok = (rows >= 0) & (rows < self.rows.shape[0])
        c0 = int(col_start)
        out = np.take(self.rows[:, c0:c0 + num_cols], np.where(ok, rows, 0), axis=0)
        out[~ok] = 0
        self.words_gathered += out.size
        return out

    def _store(self, row_start, block, count):
        n, r0 = int(count), np.asarray(row_start)
        tpp = block.shape[1]
        block = np.asarray(block)
        for i in range(n):
            if 0 <= r0[i] and r0[i] + tpp <= self.rows.shape[0]:
                self.rows[int(r0[i]):int(r0[i]) + tpp] = block[i]
        return np.int32(n)


def _callback_chunk_rows(num_entries: int) -> int:
    """Rows per host callback of `copy_host_rows` for a miss list of `num_entries` (static)."""
    return min(CALLBACK_CHUNK, num_entries)


def rows_moved(host_rows_X: jax.Array, mechanism: str) -> jax.Array:
    """Rows `copy_host_rows` moves from the host for this miss list (int32 scalar, traced): the
    valid entries for "memory_kind" (one host slice each); for "callback", whole chunks of
    `min(CALLBACK_CHUNK, X)` rows, the −1 padding of the last chunk included (what crosses the
    host/device boundary). Multiply by the row's bytes for the bytes moved."""
    n = jnp.sum(host_rows_X >= 0).astype(jnp.int32)
    if mechanism != "callback":
        return n
    C = _callback_chunk_rows(host_rows_X.shape[0])
    return (n + C - 1) // C * C


def sort_misses(host_rows_X: jax.Array, slots_X: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A miss list ordered by host row (valid entries ascending, then the −1 padding), each slot
    kept with its row: adjacent host rows become consecutive entries, which `copy_host_rows`
    and `read_host_rows` read as runs. The copy's result does not depend on the order (each
    entry writes its own slot)."""
    big = jnp.iinfo(jnp.int32).max
    key, slots = lax.sort((jnp.where(host_rows_X >= 0, host_rows_X, big), slots_X), num_keys=1)
    return jnp.where(key == big, -1, key), slots


def run_left(host_rows_X: jax.Array) -> jax.Array:
    """int32 `[X]`: how many consecutive entries from i on continue entry i's run of adjacent
    host rows (`rows[j+1] == rows[j] + 1`), itself included; 0 past the valid entries."""
    X = host_rows_X.shape[0]
    valid = host_rows_X >= 0
    nxt = jnp.concatenate([host_rows_X[1:], jnp.full((1,), -1, host_rows_X.dtype)])
    cont = valid & (nxt == host_rows_X + 1)
    i = jnp.arange(X, dtype=jnp.int32)
    end = lax.cummin(jnp.where(cont, X - 1, i), reverse=True)  # the run's last entry
    return jnp.where(valid, end - i + 1, 0).astype(jnp.int32)




def host_reads(host_rows_X: jax.Array, mechanism: str) -> jax.Array:
    """Host transfers `copy_host_rows` issues for this miss list (int32 scalar, traced): for
    "memory_kind" the slices of its runs of adjacent host rows in consecutive entries (each run
    split greedily into `HOST_RUN_SIZES`), for "callback" its chunks."""
    n = jnp.sum(host_rows_X >= 0).astype(jnp.int32)
    if mechanism == "callback":
        C = _callback_chunk_rows(host_rows_X.shape[0])
        return (n + C - 1) // C
    rows = host_rows_X
    left = run_left(rows)
    prev = jnp.concatenate([jnp.full((1,), -2, rows.dtype), rows[:-1]])
    start = (rows >= 0) & (prev + 1 != rows)
    count, rem = jnp.zeros_like(left), jnp.where(start, left, 0)
    for size in HOST_RUN_SIZES:
        count, rem = count + rem // size, rem % size
    return jnp.sum(count).astype(jnp.int32)


def _read_runs(pool, rows_X: jax.Array, n, col0, num_cols: int, init, land):
    """The memory-kind read loop over the first `n` entries of `rows_X`: each iteration reads
    the next `size` entries' host rows with one contiguous host slice, `size` the largest of
    `HOST_RUN_SIZES` that the run at the current entry still covers, moves them to device memory
    and calls `land(i, size, rows_sW, acc)` (entries i … i+size−1)."""
    left = run_left(rows_X)
    # A run is never longer than the list or the pool: larger sizes could never be chosen (and
    # their slices would not fit the operands).
    sizes = tuple(n for n in HOST_RUN_SIZES if n <= min(rows_X.shape[0], pool.shape[0]))

    def read(size):
        def f(i, acc):
            blk = lax.dynamic_slice(pool, (rows_X[i], col0), (size, num_cols))  # contiguous host slice
            # The barrier keeps the slice one read: without it XLA sinks the consumers' slices
            # (one per layer) into the host read, a host round trip per layer per row on a GPU.
            blk = lax.optimization_barrier(jax.device_put(blk, jax.memory.Space.Device))
            return land(i, size, blk, acc)
        return f

    branches = [read(size) for size in sizes]
    sizes_a = jnp.asarray(sizes, jnp.int32)

    def body(c):
        i, acc = c
        b = jnp.sum(sizes_a[:-1] > left[i]).astype(jnp.int32)  # the largest size ≤ the run's rest
        return i + sizes_a[b], lax.switch(b, branches, i, acc)

    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), init))[1]


def _one_segment(layout: GroupLayout, component: str):
    base, comp = layout.component(component)
    if len(comp.segments) != 1:
        raise ValueError(f"host rows need one-segment rows; {component!r} rows ({comp.row_dtype}) have "
                         f"{len(comp.segments)} segments")
    return base, comp


def page_to_rows(page_words: jax.Array, layout: GroupLayout, component: str) -> jax.Array:
    """One arena page (or a batch `[..., page_words]`) → its token-major host rows
    `uint32[..., tpp, L·W]` (token o's rows of every layer back to back).

    Raises ValueError for rows stored in several segments (fp8 indexer keys): the host pool holds
    one-segment rows (the MLA latent in every format)."""
    base, comp = _one_segment(layout, component)
    tpp, L, W = layout.tokens_per_page, comp.num_layers, comp.row_words
    x = page_words[..., base:base + L * tpp * W]
    x = x.reshape(*x.shape[:-1], L, tpp, W)
    x = jnp.swapaxes(x, -3, -2)
    return x.reshape(*x.shape[:-3], tpp, L * W)


def _scatter_layers(kv_arena, slots_X, rows_XnW, layout, component, first_layer, num_layers):
    """Write `rows [X, n·W]` (layers first_layer … first_layer+n−1 of each row) at `slots [X]`."""
    from kernels.paged.ops import scatter_rows

    _, comp = layout.component(component)
    W = comp.row_words
    for li in range(num_layers):
        kv_arena = scatter_rows(kv_arena, slots_X, rows_XnW[:, li * W:(li + 1) * W], layout, component,
                                first_layer + li)
    return kv_arena


def copy_host_rows(kv_arena: jax.Array, pool, host_rows_X: jax.Array, slots_X: jax.Array, layout: GroupLayout,
                   component: str, first_layer, num_layers: int, *, mechanism: str,
                   after: jax.Array | None = None, row_offset=0) -> jax.Array:
    """`gather_host_rows` into the arena: for each valid i (entries with `host_rows_X[i] ≥ 0`
    come first; the first −1 ends the list), copy host row `host_rows_X[i]`'s words of layers
    `[first_layer, first_layer + num_layers)` into arena slot `slots_X[i]` of those layers.
    "memory_kind" reads each run of consecutive entries with adjacent host rows with one slice
    per `HOST_RUN_SIZES` piece (`host_reads` counts them): order the list with `sort_misses`
    (the HiSparse resolver's lists are) to make adjacent rows consecutive.

    Args:
      kv_arena: `uint32[num_blocks, page_words]` (donate it). pool: the host pool (a pinned_host
        `jax.Array` for "memory_kind", a `HostRowStore` for "callback").
      host_rows_X, slots_X: int32 `[X]`. first_layer: int or traced int32 scalar (the stacked
        IndexShare groups scan over it); num_layers: static.
      after: callback mechanism only: an array the reads are ordered after (e.g. the step's
        host stores).
      row_offset: callback mechanism only: added to every valid host row (a shard's rows in a
        `HostRowStore` shared by the shards of a parallel layout; int or traced int32).
    Returns the updated arena. An entry with an invalid slot (−1 or inside the null block; the
    resolver never emits one) writes its row into the null block, which no reader reads.
    Raises ValueError for an unknown mechanism or rows stored in several segments.
    """
    _, comp = _one_segment(layout, component)
    W = comp.row_words
    n = jnp.sum(host_rows_X >= 0).astype(jnp.int32)
    col0 = jnp.asarray(first_layer, jnp.int32) * W
    ncols = num_layers * W
    if mechanism == "memory_kind":
        tpp = layout.tokens_per_page
        rows_s, slots_s = host_rows_X, slots_X

        def land(i, size, blk, arena):
            if size > 1:  # a run: one scatter per layer
                return _scatter_layers(arena, lax.dynamic_slice(slots_s, (i,), (size,)), blk, layout, component,
                                       first_layer, num_layers)
            row = blk.reshape(num_layers, W)
            slot = jnp.where(slots_s[i] >= tpp, slots_s[i], 0)  # an invalid slot writes the null block
            for li in range(num_layers):
                block, (start, *_) = row_location(slot, layout, component, first_layer + li)
                arena = lax.dynamic_update_slice(arena, row[li][None, :], (block, start))
            return arena

        return _read_runs(pool, rows_s, n, col0, ncols, kv_arena, land)
    if mechanism == "callback":
        X = host_rows_X.shape[0]
        C = _callback_chunk_rows(X)
        pad = (-X) % C
        rows_p = jnp.pad(jnp.where(host_rows_X >= 0, host_rows_X + row_offset, -1), (0, pad), constant_values=-1)
        slots_p = jnp.pad(slots_X, (0, pad), constant_values=-1)
        # The reads take `after` as an operand (a real data dependency: they run after the
        # step's stores; an arithmetic no-op on it would be folded away by XLA).
        dep = jnp.int32(0) if after is None else after

        def chunk(c, arena):
            r = lax.dynamic_slice(rows_p, (c * C,), (C,))
            s = lax.dynamic_slice(slots_p, (c * C,), (C,))
            got = io_callback(lambda rr, cc, aa: pool._gather(rr, cc, ncols, aa),
                              jax.ShapeDtypeStruct((C, ncols), jnp.uint32), r, col0, dep, ordered=False)
            return _scatter_layers(arena, s, got, layout, component, first_layer, num_layers)

        return lax.fori_loop(0, (n + C - 1) // C, chunk, kv_arena)
    raise ValueError(f"unknown host-row mechanism {mechanism!r}; expected one of {MECHANISMS}")


def _num_valid(idx_C: jax.Array) -> jax.Array:
    """Leading entries ≥ 1 (the first entry < 1 ends the list)."""
    valid = idx_C >= 1
    return jnp.argmin(jnp.concatenate([valid, jnp.zeros((1,), bool)])).astype(jnp.int32)


def split_words(row_words: int, num_parts: int) -> int:
    """Words of one layer's row in each of `num_parts` column parts (rows padded to a multiple
    of the parts): ⌈row_words / num_parts⌉."""
    return -(-row_words // num_parts)


def column_part(rows_XLW: jax.Array, num_layers: int, row_words: int, num_parts: int, part) -> jax.Array:
    """Host rows `[..., L·W]` → column part `part` of `num_parts`: `[..., L·Wp]`, each layer's row
    zero-padded to `num_parts · Wp` words and cut into equal parts (Wp = `split_words`). A pool
    split this way keeps one copy of every row over the parts, and every group's layers stay
    contiguous in each part."""
    wp = split_words(row_words, num_parts)
    x = rows_XLW.reshape(*rows_XLW.shape[:-1], num_layers, row_words)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, wp * num_parts - row_words)])
    x = lax.dynamic_slice_in_dim(x, jnp.asarray(part, jnp.int32) * wp, wp, axis=x.ndim - 1)
    return x.reshape(*rows_XLW.shape[:-1], num_layers * wp)


def join_column_parts(parts_RXnW: jax.Array, num_layers: int, row_words: int) -> jax.Array:
    """Inverse of `column_part` for `num_layers` layers: the parts `[R, X, n·Wp]` of rows (all
    of them, part r first) → the rows `[X, n·W]`."""
    R, X, _ = parts_RXnW.shape
    x = parts_RXnW.reshape(R, X, num_layers, -1)
    x = jnp.moveaxis(x, 0, 2).reshape(X, num_layers, -1)[..., :row_words]
    return x.reshape(X, num_layers * row_words)


def read_host_rows(pool, host_rows_X: jax.Array, col_start, num_cols: int, num_out: int, *, mechanism: str,
                   row_offset=0) -> jax.Array:
    """Words `[col_start, col_start + num_cols)` of host rows `host_rows_X` (valid entries ≥ 0
    first; the first −1 ends the list) → a device buffer `uint32[num_out, num_cols]` (row i =
    entry i; rows past the valid entries or past `num_out` are zero). The building block of a
    pool split by columns over devices: each device reads its part of the same rows, then the
    parts are all-gathered (`join_column_parts`).

    row_offset: callback mechanism only (as `copy_host_rows`). Raises ValueError for an unknown
    mechanism."""
    n = jnp.minimum(jnp.sum(host_rows_X >= 0), num_out).astype(jnp.int32)
    col0 = jnp.asarray(col_start, jnp.int32)
    buf = jnp.zeros((num_out, num_cols), jnp.uint32)
    if mechanism == "memory_kind":
        # Runs of adjacent host rows among consecutive entries are read with one slice each
        # (the caller orders the list with `sort_misses` to make them consecutive). A run is cut
        # at `num_out`: the slice never runs past the buffer.
        rows = jnp.where(jnp.arange(host_rows_X.shape[0]) < n, host_rows_X, -1)

        def land(i, size, blk, b):
            return lax.dynamic_update_slice(b, blk, (i, 0))

        return _read_runs(pool, rows, n, col0, num_cols, buf, land)
    if mechanism == "callback":
        rows = jnp.where(jnp.arange(host_rows_X.shape[0]) < n, host_rows_X, -1)[:num_out]
        rows = jnp.where(rows >= 0, rows + row_offset, -1)
        rows = jnp.pad(rows, (0, num_out - rows.shape[0]), constant_values=-1)
        return io_callback(lambda rr, cc, aa: pool._gather(rr, cc, num_cols, aa),
                           jax.ShapeDtypeStruct((num_out, num_cols), jnp.uint32), rows, col0, jnp.int32(0),
                           ordered=False)
    raise ValueError(f"unknown host-row mechanism {mechanism!r}; expected one of {MECHANISMS}")


def scatter_host_rows(kv_arena: jax.Array, slots_X: jax.Array, rows_XnW: jax.Array, layout: GroupLayout,
                      component: str, first_layer, num_layers: int) -> jax.Array:
    """Write rows `[X, n·W]` (layers `[first_layer, first_layer + n)` of each) at arena slots
    `[X]`; −1 and null-block slots are dropped."""
    return _scatter_layers(kv_arena, slots_X, rows_XnW, layout, component, first_layer, num_layers)


def store_pages(pool, kv_arena: jax.Array, src_blocks_C: jax.Array, dst_blocks_C: jax.Array, layout: GroupLayout,
                component: str, *, mechanism: str, num_parts: int = 1, part=0, row_offset=0, enabled=True):
    """The write-through pre-copy: host block `dst_blocks_C[i]` ← arena page `src_blocks_C[i]`
    (all layers of the component, token-major), for the leading entries with `dst ≥ 1` (the
    first entry < 1 ends the list).

    Parallel layouts (one shard of the pool per device): `num_parts`/`part` (memory_kind) store
    only column part `part` of the rows (`column_part`; the pool's columns are split over the
    devices that hold the same KV); `row_offset` (callback: the shard's first row in the shared
    `HostRowStore`) and `enabled` (callback: False on the devices that must not write, so a row
    is written once) may be traced.

    Returns `(pool, done)`: the updated pool (the same `HostRowStore` object for "callback") and
    an int32 scalar that is ready once the stores ran (order later reads after it).
    """
    tpp = layout.tokens_per_page
    n = _num_valid(dst_blocks_C)
    if mechanism == "memory_kind":
        _, comp = _one_segment(layout, component)

        def body(i, p):
            page = lax.dynamic_slice_in_dim(kv_arena, src_blocks_C[i], 1, axis=0)[0]
            rows = page_to_rows(page, layout, component)
            if num_parts > 1:
                rows = column_part(rows, comp.num_layers, comp.row_words, num_parts, part)
            rows = jax.device_put(rows, jax.memory.Space.Host)
            return lax.dynamic_update_slice(p, rows, (dst_blocks_C[i] * tpp, 0))

        return lax.fori_loop(0, n, body, pool), n
    if mechanism == "callback":
        n = jnp.where(enabled, n, 0)

        def body(i, acc):
            page = lax.dynamic_slice_in_dim(kv_arena, src_blocks_C[i], 1, axis=0)
            rows = page_to_rows(page, layout, component)  # [1, tpp, L·W]
            return acc + io_callback(pool._store, jax.ShapeDtypeStruct((), jnp.int32),
                                     (dst_blocks_C[i] * tpp + row_offset)[None], rows, jnp.int32(1), ordered=False)

        return pool, lax.fori_loop(0, n, body, jnp.int32(0))
    raise ValueError(f"unknown host-row mechanism {mechanism!r}; expected one of {MECHANISMS}")


# ----------------------------------------------------------------------------- whole pages
# The KV offloading connector keeps whole arena pages of any group in a host page store
# `uint32[num_host_blocks, page_words]` (block 0 null): a page is one contiguous row, so a store
# is one contiguous `[1, page_words]` slab moved to host memory and a load one contiguous host
# slice moved to device memory — both XLA's supported host-offload pattern. For the "callback"
# mechanism the store is a `HostRowStore` whose rows are pages (one "token" per page).


def store_arena_pages(host, kv_arena: jax.Array, src_blocks_C: jax.Array, dst_blocks_C: jax.Array, *,
                      mechanism: str, row_offset=0):
    """Host block `dst_blocks_C[i]` ← arena page `src_blocks_C[i]` (whole pages, every group's
    format), for the leading entries with `dst ≥ 1`.

    Args:
      host: the page store (`pinned_host` `jax.Array` `uint32[N, page_words]` for "memory_kind",
        donate it; a `HostRowStore` of N rows × page_words for "callback").
      kv_arena: `uint32[num_blocks, page_words]` (read only).
      src_blocks_C, dst_blocks_C: int32 `[C]`, −1 padded.
      row_offset: "callback" only: added to the host rows (a KV shard's part of a shared store,
        inside `shard_map`); a "memory_kind" shard is addressed locally.
    Returns `(host, done)`: the updated store and an int32 scalar ready once the stores ran.
    Raises ValueError for an unknown mechanism.
    """
    n = _num_valid(dst_blocks_C)
    if mechanism == "memory_kind":
        def body(i, h):
            page = lax.dynamic_slice_in_dim(kv_arena, src_blocks_C[i], 1, axis=0)
            return lax.dynamic_update_slice(h, jax.device_put(page, jax.memory.Space.Host), (dst_blocks_C[i], 0))

        return lax.fori_loop(0, n, body, host), n
    if mechanism == "callback":
        def body(i, acc):
            page = lax.dynamic_slice_in_dim(kv_arena, src_blocks_C[i], 1, axis=0)[:, None, :]  # [1, 1, PW]
            return acc + io_callback(host._store, jax.ShapeDtypeStruct((), jnp.int32),
                                     (dst_blocks_C[i] + row_offset)[None], page,
                                     jnp.int32(1), ordered=False)

        return host, lax.fori_loop(0, n, body, jnp.int32(0))
    raise ValueError(f"unknown host-row mechanism {mechanism!r}; expected one of {MECHANISMS}")


def load_arena_pages(kv_arena: jax.Array, host, src_blocks_C: jax.Array, dst_blocks_C: jax.Array, *,
                     mechanism: str, row_offset=0) -> jax.Array:
    """Arena page `dst_blocks_C[i]` ← host block `src_blocks_C[i]`, for the leading entries with
    `dst ≥ 1` (the inverse of `store_arena_pages`; donate the arena; `row_offset` as there).

    Returns the updated arena. Raises ValueError for an unknown mechanism.
    """
    n = _num_valid(dst_blocks_C)
    PW = kv_arena.shape[1]
    if mechanism == "memory_kind":
        def body(i, arena):
            page = lax.dynamic_slice(host, (src_blocks_C[i], 0), (1, PW))  # contiguous host slice
            page = jax.device_put(page, jax.memory.Space.Device)
            return lax.dynamic_update_slice(arena, page, (dst_blocks_C[i], 0))

        return lax.fori_loop(0, n, body, kv_arena)
    if mechanism == "callback":
        def body(i, arena):
            page = io_callback(lambda r, c, a: host._gather(r, c, PW, a), jax.ShapeDtypeStruct((1, PW), jnp.uint32),
                               (src_blocks_C[i] + row_offset)[None], jnp.int32(0), jnp.int32(0), ordered=False)
            return lax.dynamic_update_slice(arena, page, (dst_blocks_C[i], 0))

        return lax.fori_loop(0, n, body, kv_arena)
    raise ValueError(f"unknown host-row mechanism {mechanism!r}; expected one of {MECHANISMS}")
