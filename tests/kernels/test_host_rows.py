"""Host-pool transfers (kernels/host_rows) against numpy, for both mechanisms: page stores land
token-major at the right host block, row copies land byte-exact in the right slots of exactly the
layers asked for, and stacked IndexShare groups (a `lax.scan` over groups, traced first layer)
never write one layer's rows at another layer's offset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import SingleDeviceSharding

from kernels.host_rows import HostRowStore, copy_host_rows, page_to_rows, store_pages
from kernels.paged import CacheComponent, GroupLayout, gather_rows, write_cache

TPP, L = 4, 6


def make_pool(mechanism, rows, words):
    if mechanism == "callback":
        return HostRowStore(rows, words)
    return jax.device_put(np.zeros((rows, words), np.uint32),
                          SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


def pool_array(pool):
    return pool.rows if isinstance(pool, HostRowStore) else np.asarray(pool)


@pytest.mark.parametrize("mechanism", ["memory_kind", "callback"])
@pytest.mark.parametrize("row_dtype", ["float32", "fp8_ds_mla"])
def test_page_stores_then_row_copies_are_byte_exact(mechanism, row_dtype):
    width, rope = (256 + 16, 16) if row_dtype == "fp8_ds_mla" else (12, 0)
    lay = GroupLayout("mla", TPP, (CacheComponent("mla", L, width, row_dtype, rope_dim=rope),))
    W = lay.components[0].row_words
    rng = np.random.default_rng(0)
    arena = rng.integers(0, 2**32, (10, lay.words_per_page), dtype=np.uint32)
    pool = make_pool(mechanism, 8 * TPP, L * W)
    src, dst = np.array([3, 7, 5, 0], np.int32), np.array([2, 6, 4, 0], np.int32)  # the 0 ends the list
    store = jax.jit(lambda p, a: store_pages(p, a, jnp.asarray(src), jnp.asarray(dst), lay, "mla",
                                             mechanism=mechanism))
    pool, done = store(pool, jnp.asarray(arena))
    assert int(done) == 3
    host = pool_array(pool)
    for s, d in zip(src[:3], dst[:3]):
        want = arena[s].reshape(L, TPP, W).transpose(1, 0, 2).reshape(TPP, L * W)  # token-major
        np.testing.assert_array_equal(host[d * TPP:(d + 1) * TPP], want)
        np.testing.assert_array_equal(np.asarray(page_to_rows(jnp.asarray(arena[s]), lay, "mla")), want)
    assert not host[:2 * TPP].any() and not host[3 * TPP:4 * TPP].any()
    # Rows of two host blocks into hot slots of pages 8 and 9, layers 2..4 only.
    rows = np.array([2 * TPP + 1, 6 * TPP + 3, 4 * TPP, -1, -1], np.int32)
    slots = np.array([8 * TPP + 2, 9 * TPP + 0, 9 * TPP + 3, -1, -1], np.int32)
    copy = jax.jit(lambda a, p: copy_host_rows(a, p, jnp.asarray(rows), jnp.asarray(slots), lay, "mla", 2, 3,
                                               mechanism=mechanism))
    out = np.asarray(copy(jnp.asarray(arena), pool))
    for h, s in zip(rows[:3], slots[:3]):
        for layer in range(L):
            got = np.asarray(gather_rows(jnp.asarray(out), jnp.asarray([s]), lay, "mla", layer))[0]
            before = np.asarray(gather_rows(jnp.asarray(arena), jnp.asarray([s]), lay, "mla", layer))[0]
            want = host[h, layer * W:(layer + 1) * W] if 2 <= layer < 5 else before
            np.testing.assert_array_equal(got, want)
    assert int((out != arena).any(axis=1).sum()) <= 2  # only the two hot pages changed


@pytest.mark.parametrize("mechanism", ["memory_kind", "callback"])
def test_stacked_groups_write_each_layer_at_its_own_offset(mechanism):
    """Six layers in three IndexShare groups of two, scanned with a traced first layer (as the
    model's stacked groups are). Every layer's rows carry their own sentinel, on the device
    (resident pages) and in the host pool; after each group copies its misses, every layer of
    every hot slot reads back its own sentinel and the resident rows are untouched."""
    lay = GroupLayout("mla", TPP, (CacheComponent("mla", L, 8, "float32"),))
    W = 8

    def sentinel(layer, token):
        return np.full(W, 1000 * (layer + 1) + token, np.float32)

    arena = jnp.zeros((12, lay.words_per_page), jnp.uint32)
    res_slots = jnp.arange(TPP, 3 * TPP, dtype=jnp.int32)  # pages 1 and 2: resident tokens 0..7
    for layer in range(L):
        arena = write_cache(arena, jnp.asarray(np.stack([sentinel(layer, t) for t in range(8)])), res_slots,
                            lay, "mla", layer)
    pool = make_pool(mechanism, 6 * TPP, L * W)
    host = np.zeros((6 * TPP, L * W), np.float32)
    for r in range(TPP, 6 * TPP):  # host rows of tokens 100 + r
        host[r] = np.concatenate([sentinel(layer, 100 + r) for layer in range(L)])
    if mechanism == "callback":
        pool.rows[:] = host.view(np.uint32)
    else:
        pool = jax.device_put(host.view(np.uint32), SingleDeviceSharding(jax.devices()[0],
                                                                         memory_kind="pinned_host"))
    hot_rows = jnp.asarray([TPP + 1, 3 * TPP + 2, 5 * TPP + 3, -1], jnp.int32)
    hot_slots = jnp.asarray([8 * TPP, 9 * TPP + 1, 10 * TPP + 2, -1], jnp.int32)

    @jax.jit
    def run(arena, pool):
        def body(a, g):
            return copy_host_rows(a, pool, hot_rows, hot_slots, lay, "mla", 2 * g, 2, mechanism=mechanism), None

        return lax.scan(body, arena, jnp.arange(3, dtype=jnp.int32))[0]

    out = run(arena, pool)
    for layer in range(L):
        got = np.asarray(gather_rows(out, hot_slots[:3], lay, "mla", layer)).view(np.float32)
        for i, r in enumerate((TPP + 1, 3 * TPP + 2, 5 * TPP + 3)):
            np.testing.assert_array_equal(got[i], sentinel(layer, 100 + r))
        res = np.asarray(gather_rows(out, res_slots, lay, "mla", layer)).view(np.float32)
        np.testing.assert_array_equal(res, np.stack([sentinel(layer, t) for t in range(8)]))


@pytest.mark.parametrize("mechanism", ["memory_kind", "callback"])
def test_whole_page_stores_and_loads_round_trip_byte_exact(mechanism):
    """The offloading connector's ops: pages of random words stored to host blocks, then loaded
    into other arena pages, equal the originals word for word; −1 padding ends each list and
    pages not named are untouched; the programs read host memory only through slices and moves."""
    from kernels.host_rows import load_arena_pages, store_arena_pages
    from serving.hisparse.device_state import make_host_pool
    from tests.helpers.host_memory import host_memory_reads

    rng = np.random.default_rng(0)
    arena0 = rng.integers(0, 2**32, (12, 40), dtype=np.uint32)
    host = make_host_pool(mechanism, 9, 40)
    src = jnp.asarray([3, 7, 1, -1, -1, -1, -1, -1], jnp.int32)  # arena pages → host blocks 5, 2, 8
    dst = jnp.asarray([5, 2, 8, -1, -1, -1, -1, -1], jnp.int32)
    store = jax.jit(lambda h, a, s, d: store_arena_pages(h, a, s, d, mechanism=mechanism))
    host, done = store(host, jnp.asarray(arena0), src, dst)
    jax.block_until_ready(done)
    load = jax.jit(lambda a, h, s, d: load_arena_pages(a, h, s, d, mechanism=mechanism))
    arena = load(jnp.asarray(arena0), host, jnp.asarray([5, 2, 8, -1], jnp.int32), jnp.asarray([10, 11, 4, -1],
                                                                                              jnp.int32))
    got = np.asarray(arena)
    want = arena0.copy()
    want[[10, 11, 4]] = arena0[[3, 7, 1]]
    np.testing.assert_array_equal(got, want)
    host_np = np.asarray(host.rows if mechanism == "callback" else host)
    np.testing.assert_array_equal(host_np[[5, 2, 8]], arena0[[3, 7, 1]])
    assert not host_np[[0, 1, 3, 4, 6, 7]].any()
    if mechanism == "memory_kind":
        reads = host_memory_reads(jax.make_jaxpr(store)(host, jnp.asarray(arena0), src, dst))
        reads += host_memory_reads(jax.make_jaxpr(load)(jnp.asarray(arena0), host, src, dst))
        assert [r for r in reads if r[1] != "ok"] == []
        assert {"dynamic_slice", "device_put", "dynamic_update_slice"} <= {n for n, _ in reads}


@pytest.mark.parametrize("parts", [2, 3])
def test_a_pool_split_by_columns_holds_every_row_once_and_reads_back_exact(parts):
    """The layout of a pool shared by devices that hold the same KV (TP): each part stores its
    column part of every page (`store_pages(num_parts=, part=)`), `read_host_rows` reads a
    group's layers of some rows from each part, and `join_column_parts` reassembles them
    exactly; the parts together are the rows once (plus the per-layer padding to a multiple of
    the parts)."""
    from kernels.host_rows import join_column_parts, read_host_rows, split_words

    lay = GroupLayout("mla", TPP, (CacheComponent("mla", L, 10, "float32"),))  # W = 10 words
    W = lay.components[0].row_words
    wp = split_words(W, parts)
    assert wp * parts >= W and wp * (parts - 1) < W
    rng = np.random.default_rng(3)
    arena = rng.integers(0, 2**32, (6, lay.words_per_page), dtype=np.uint32)
    src, dst = np.array([4, 1, -1], np.int32), np.array([2, 5, -1], np.int32)
    pools = []
    for p in range(parts):
        pool = make_pool("memory_kind", 6 * TPP, L * wp)
        pool, _ = jax.jit(lambda q, a, p=p: store_pages(q, a, jnp.asarray(src), jnp.asarray(dst), lay, "mla",
                                                        mechanism="memory_kind", num_parts=parts, part=p))(
            pool, jnp.asarray(arena))
        pools.append(pool)
    assert sum(pool_array(q).nbytes for q in pools) == 6 * TPP * L * wp * parts * 4
    rows = jnp.asarray([5 * TPP + 1, 2 * TPP + 3, -1, -1], jnp.int32)
    first, n = 1, 3  # layers 1..3
    got_parts = jnp.stack([jax.jit(lambda q: read_host_rows(q, rows, first * wp, n * wp, 4,
                                                            mechanism="memory_kind"))(q) for q in pools])
    got = np.asarray(join_column_parts(got_parts, n, W))
    for i, (blk, off) in enumerate([(1, 1), (4, 3)]):  # host block 5 ← page 1, block 2 ← page 4
        want = arena[blk].reshape(L, TPP, W)[first:first + n, off].reshape(-1)
        np.testing.assert_array_equal(got[i], want)
    assert not got[2:].any()  # past the valid rows: zeros


def test_callback_stores_take_a_row_offset_and_can_be_disabled():
    """The shared numpy pool of a parallel layout: a shard writes at its row offset, and only
    one of the devices holding the same KV writes (`enabled`)."""
    lay = GroupLayout("mla", TPP, (CacheComponent("mla", L, 12, "float32"),))
    W = lay.components[0].row_words
    arena = np.random.default_rng(4).integers(0, 2**32, (4, lay.words_per_page), dtype=np.uint32)
    store = HostRowStore(2 * 4 * TPP, L * W)  # two shards of 4 blocks
    src, dst = jnp.asarray([3, -1], jnp.int32), jnp.asarray([1, -1], jnp.int32)
    f = jax.jit(lambda a, on: store_pages(store, a, src, dst, lay, "mla", mechanism="callback",
                                          row_offset=4 * TPP, enabled=on)[1])
    assert int(f(jnp.asarray(arena), False)) == 0 and not store.rows.any()
    assert int(f(jnp.asarray(arena), True)) == 1
    want = arena[3].reshape(L, TPP, W).transpose(1, 0, 2).reshape(TPP, L * W)
    np.testing.assert_array_equal(store.rows[5 * TPP:6 * TPP], want)
    assert not store.rows[:5 * TPP].any() and not store.rows[6 * TPP:].any()


def test_memory_kind_reads_each_missed_row_once_for_all_its_layers():
    """A missed row of a group of n layers is one contiguous host run: the compiled copy reads it
    with one slice (the optimization barrier in `copy_host_rows`), not one slice per layer — on a
    GPU each host slice is a host round trip. (Without the barrier XLA:CPU compiled three
    `u32[1, 3W]` host slices per row here, one per layer's update.)"""
    lay = GroupLayout("mla", TPP, (CacheComponent("mla", L, 12, "float32"),))
    W = lay.components[0].row_words
    pool = make_pool("memory_kind", 32, L * W)
    arena = jnp.zeros((10, lay.words_per_page), jnp.uint32)
    rows, slots = jnp.asarray([9, 25, 16, -1], jnp.int32), jnp.asarray([34, 36, 39, -1], jnp.int32)
    copy = jax.jit(lambda a, p, r, s: copy_host_rows(a, p, r, s, lay, "mla", 2, 3, mechanism="memory_kind"))
    hlo = copy.lower(arena, pool, rows, slots).compile().as_text()
    reads = [line for line in hlo.splitlines() if "dynamic-slice(" in line and line.split("=")[1].strip().startswith("u32[1,")]
    assert len(reads) == 1 and f"u32[1,{3 * W}]" in reads[0], reads
    out = np.asarray(copy(arena, pool, rows, slots))  # and the copy itself still lands (all zeros here)
    assert out.shape == arena.shape


def _greedy_reads(runs):
    """Host slices for runs of these lengths, each split greedily into 64, 16, 4 and 1 rows."""
    count = 0
    for n in runs:
        for size in (64, 16, 4, 1):
            count, n = count + n // size, n % size
    return count


@pytest.mark.parametrize("mechanism", ["memory_kind", "callback"])
def test_runs_of_adjacent_host_rows_are_read_together_and_land_exact(mechanism):
    """A shuffled miss list with runs of 70 and 5 adjacent host rows, three single rows and one
    host row missed twice (two requests sharing a prefix block, two slots): after `sort_misses`
    the memory-kind copy reads each run in its greedy pieces (70 = 64 + 4 + 1 + 1, 5 = 4 + 1: 11
    host slices for 80 rows, `host_reads` and the compiled program's slice shapes agree) and
    every row lands in its own slot, byte-exact against numpy; the callback copy is one chunk."""
    from kernels.host_rows import host_reads, run_left, sort_misses

    lay = GroupLayout("mla", TPP, (CacheComponent("mla", L, 12, "float32"),))
    W = lay.components[0].row_words
    rng = np.random.default_rng(7)
    host = rng.integers(0, 2**32, (64 * TPP, L * W), dtype=np.uint32)
    pool = make_pool(mechanism, *host.shape)
    if mechanism == "callback":
        pool.rows[:] = host
    else:
        pool = jax.device_put(host, SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    rows = np.concatenate([np.arange(30, 100), np.arange(150, 155), [5, 120, 200], [110, 110]]).astype(np.int32)
    slots = (np.arange(len(rows)) + 40 * TPP).astype(np.int32)  # pages 40…60: distinct slots
    perm = rng.permutation(len(rows))
    rows_X = jnp.asarray(np.concatenate([rows[perm], [-1] * 6]).astype(np.int32))
    slots_X = jnp.asarray(np.concatenate([slots[perm], [-1] * 6]).astype(np.int32))
    r_s, s_s = sort_misses(rows_X, slots_X)
    assert np.asarray(r_s).tolist() == sorted(rows.tolist()) + [-1] * 6
    assert sorted(zip(np.asarray(r_s)[:len(rows)].tolist(), np.asarray(s_s)[:len(rows)].tolist())) == sorted(
        zip(rows.tolist(), slots.tolist()))  # each slot kept with its row
    assert np.asarray(run_left(r_s))[[0, 1, 2, 70, 71]].tolist() == [1, 70, 69, 1, 1]  # 5 | 30 | 31 | 99 | 110
    want_reads = _greedy_reads([70, 5, 1, 1, 1, 1, 1]) if mechanism == "memory_kind" else 1
    assert want_reads == (11 if mechanism == "memory_kind" else 1)
    assert int(host_reads(r_s, mechanism)) == want_reads
    arena = rng.integers(0, 2**32, (64, lay.words_per_page), dtype=np.uint32)
    copy = jax.jit(lambda a, p, r, s: copy_host_rows(a, p, r, s, lay, "mla", 1, 4, mechanism=mechanism))
    out = copy(jnp.asarray(arena), pool, r_s, s_s)
    for layer in range(L):
        got = np.asarray(gather_rows(out, jnp.asarray(slots), lay, "mla", layer))
        before = np.asarray(gather_rows(jnp.asarray(arena), jnp.asarray(slots), lay, "mla", layer))
        want = host[rows, layer * W:(layer + 1) * W] if 1 <= layer < 5 else before
        np.testing.assert_array_equal(got, want)
    changed = np.nonzero((np.asarray(out) != arena).any(axis=1))[0]
    assert set(changed.tolist()) <= set(range(40, 40 + -(-len(rows) // TPP)))
    if mechanism == "memory_kind":
        hlo = copy.lower(jnp.asarray(arena), pool, r_s, s_s).compile().as_text()
        shapes = {line.split("=")[1].strip().split("{")[0] for line in hlo.splitlines() if "dynamic-slice(" in line}
        assert {f"u32[{n},{4 * W}]" for n in (64, 16, 4, 1)} <= shapes, shapes  # one host slice per run piece


def test_read_host_rows_reads_runs_and_stops_at_its_buffer():
    """The column-split read path: runs among consecutive entries are read together, row i of
    the buffer is entry i, and a run longer than the buffer is cut at its end."""
    from kernels.host_rows import read_host_rows

    host = np.random.default_rng(8).integers(0, 2**32, (100, 6), dtype=np.uint32)
    pool = jax.device_put(host, SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    rows = jnp.asarray(list(range(10, 30)) + [50, 3, -1, -1], jnp.int32)
    for num_out in (24, 18):
        got = np.asarray(jax.jit(lambda p, k=num_out: read_host_rows(p, rows, 2, 3, k, mechanism="memory_kind"))(pool))
        want = np.zeros((num_out, 3), np.uint32)
        valid = [r for r in np.asarray(rows).tolist() if r >= 0][:num_out]
        want[:len(valid)] = host[valid, 2:5]
        np.testing.assert_array_equal(got, want)
