"""Cache writes / reads and position→slot conversion against direct numpy indexing."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.paged import copy_pages, decode_rows, encode_rows, positions_to_slots, read_cache, write_cache
from tests.kernels.conftest import make_layout, scatter_dense


@pytest.mark.parametrize("row_dtype", ["float32", "bfloat16"])
def test_encode_decode_roundtrip(rng, row_dtype):
    x = rng.standard_normal((5, 16)).astype(np.float32)
    y = np.asarray(decode_rows(encode_rows(jnp.asarray(x), row_dtype), row_dtype))
    ref = x if row_dtype == "float32" else np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(y, ref)


def test_write_then_read_each_layer_independent(rng):
    lay = make_layout(6, num_layers=3, tpp=4)
    seqs0 = [rng.standard_normal((9, 6)).astype(np.float32)]
    arena, bt, slots = scatter_dense(lay, 8, seqs0, 0, rng)
    other = rng.standard_normal((9, 6)).astype(np.float32)
    arena = write_cache(arena, jnp.asarray(other), jnp.asarray(slots[0], jnp.int32), lay, "c", 2)
    np.testing.assert_array_equal(np.asarray(read_cache(arena, jnp.asarray(slots[0]), lay, "c", 0)), seqs0[0])
    np.testing.assert_array_equal(np.asarray(read_cache(arena, jnp.asarray(slots[0]), lay, "c", 2)), other)


def test_minus_one_and_null_block_writes_are_dropped(rng):
    lay = make_layout(4, num_layers=1, tpp=4)
    arena = jnp.zeros((3, 4 * 4), jnp.uint32)
    vals = jnp.ones((3, 4), jnp.float32)
    out = write_cache(arena, vals, jnp.asarray([-1, 0, 3], jnp.int32), lay, "c", 0)  # all in null block / none
    np.testing.assert_array_equal(np.asarray(out), np.zeros((3, 16), np.uint32))
    out = write_cache(arena, vals, jnp.asarray([-1, 5, 0], jnp.int32), lay, "c", 0)
    assert np.asarray(out)[1].view(np.float32)[4:8].tolist() == [1.0] * 4
    assert np.asarray(out)[0].sum() == 0


def test_positions_to_slots_matches_formula(rng):
    tpp = 4
    bt = np.array([[3, 1, 0], [2, 5, 4]], np.int32)
    pos = np.array([[0, 5, 7, -1, 9], [11, 0, 4, 3, -1]], np.int32)
    req = np.array([0, 1], np.int32)
    got = np.asarray(positions_to_slots(jnp.asarray(pos), jnp.asarray(bt), jnp.asarray(req), tpp))
    want = np.full_like(pos, -1)
    for t in range(2):
        for k in range(pos.shape[1]):
            p = pos[t, k]
            if p >= 0 and bt[req[t], p // tpp] != 0:
                want[t, k] = bt[req[t], p // tpp] * tpp + p % tpp
    np.testing.assert_array_equal(got, want)
    assert got[0, 4] == -1  # page 2 of request 0 is the null block


def test_copy_pages_in_order_with_padding(rng):
    arena = rng.integers(0, 2**32, size=(6, 10), dtype=np.uint32)
    # 1 -> 2, then 2 -> 3 (reads the copy just made), then 4 -> 1; padding after the first -1.
    src = np.array([1, 2, 4, 5, 0], np.int32)
    dst = np.array([2, 3, 1, -1, 5], np.int32)
    ref = arena.copy()
    for s, d in zip(src[:3], dst[:3]):
        ref[d] = ref[s]
    out = np.asarray(copy_pages(jnp.asarray(arena), jnp.asarray(src), jnp.asarray(dst)))
    np.testing.assert_array_equal(out, ref)
    none = np.asarray(copy_pages(jnp.asarray(arena), jnp.asarray(src), jnp.full(5, -1, jnp.int32)))
    np.testing.assert_array_equal(none, arena)
