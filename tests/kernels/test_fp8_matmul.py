"""Block-scaled FP8 weight matmuls: the quantiser, the reference and the Pallas kernels (interpret
mode) against float64 numpy computed from the fp8 codes × scales (independent of the code under
test); TP/EP shards; dispatch rules.

Tolerances, with `bound = |x| @ |w|` (float64, elementwise; the size any rounding scales with):
  * fp32 x (and bf16 x with a float32 output from the kernel, whose products are exact):
    |got − want| ≤ 1e-5 · bound (fp32 accumulation; different summation orders);
  * bf16 x: the oracle uses the bf16 values of x (so the rounding of x itself is not an error);
    the reference rounds the dequantised weight to bf16 (unit roundoff 2^-8 relative per
    product) and the output to bf16 (2^-8 of |want|): |got − want| ≤ 2^-7 · bound.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels.fp8_matmul import api
from kernels.fp8_matmul.pallas_triton import (fp8_grouped_matmul_pallas_triton, fp8_matmul_pallas_triton,
                                              tile_metadata, unsupported_reason)
from kernels.fp8_matmul.reference import (FP8_MAX, dequantize_fp8_blocks, fp8_grouped_matmul_reference,
                                          fp8_matmul_reference, quantize_fp8_blocks, quantize_fp8_blocks_np)

BLOCK = (16, 32)  # small and unequal


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _weights(rng, shape, block, zero_block=False):
    """Random `[..., K, N]` weights whose blocks span several orders of magnitude (each block gets
    its own scale), quantised; optionally with an all-zero block. Returns (w, w_fp8, scale_inv)."""
    *lead, K, N = shape
    bk, bn = block
    mag = 10.0 ** rng.uniform(-3, 2, size=(*lead, -(-K // bk), -(-N // bn)))
    w = rng.standard_normal(shape) * np.repeat(np.repeat(mag, bk, -2), bn, -1)[..., :K, :N]
    if zero_block:
        w[..., :bk, bn:2 * bn] = 0.0
    w = w.astype(np.float32)
    w_fp8, scale = quantize_fp8_blocks(jnp.asarray(w), block)
    return w, w_fp8, scale


def deq64(w_fp8, scale, block):
    """float64 real weight from the fp8 codes and the scales (plain numpy indexing)."""
    codes = np.asarray(w_fp8).astype(np.float64)
    K, N = codes.shape[-2:]
    s = np.asarray(scale).astype(np.float64)
    return codes * s[..., np.arange(K)[:, None] // block[0], np.arange(N)[None, :] // block[1]]


def _x(rng, shape, dtype):
    x = jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return x, np.asarray(x.astype(jnp.float32)).astype(np.float64)  # the oracle sees x's stored values


def _check(got, x64, w64, tol):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32)).astype(np.float64)
    want = x64 @ w64
    bound = np.abs(x64) @ np.abs(w64)
    err = np.abs(got - want)
    assert np.all(err <= tol * bound + 1e-30), (err / np.maximum(bound, 1e-30)).max()


def _tol(x_dtype, out_dtype=None):
    return 1e-5 if jnp.dtype(out_dtype or x_dtype) == jnp.float32 else 2.0 ** -7


# ----------------------------------------------------------------------------- quantiser


@pytest.mark.parametrize("shape,block", [((50, 70), BLOCK), ((3, 40, 20), (8, 16)), ((128, 96), (128, 128))])
def test_quantize_round_trip(rng, shape, block):
    w, w_fp8, scale = _weights(rng, shape, block, zero_block=True)
    assert w_fp8.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    *lead, K, N = shape
    assert scale.shape == (*lead, -(-K // block[0]), -(-N // block[1]))
    s64 = deq64(np.ones_like(np.asarray(w_fp8)), scale, block)  # each entry's block scale
    back = deq64(w_fp8, scale, block)
    # e4m3: half an ulp is 2^-4 relative for normal codes, 2^-10 (absolute, × scale) for subnormal ones.
    assert np.all(np.abs(back - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * s64)
    # Each non-zero block's largest entry is ±448 exactly; the all-zero block has scale 1 and zero codes.
    codes = np.abs(np.asarray(w_fp8).astype(np.float32))
    Kb, Nb = scale.shape[-2:]
    for kb in range(Kb):
        for nb in range(Nb):
            blk = codes[..., kb * block[0]:(kb + 1) * block[0], nb * block[1]:(nb + 1) * block[1]]
            amax = np.abs(w[..., kb * block[0]:(kb + 1) * block[0], nb * block[1]:(nb + 1) * block[1]]).max(
                axis=(-2, -1))
            s = np.asarray(scale)[..., kb, nb]
            if kb == 0 and nb == 1:
                assert np.all(s == 1.0) and np.all(blk == 0)
            else:
                assert np.all(blk.max(axis=(-2, -1)) == FP8_MAX)
                np.testing.assert_array_equal(s, (amax / np.float32(448)).astype(np.float32))
    # The JAX dequantiser, and the numpy quantiser bit for bit.
    np.testing.assert_array_equal(np.asarray(dequantize_fp8_blocks(w_fp8, scale, block)), back.astype(np.float32))
    q_np, s_np = quantize_fp8_blocks_np(w, block)
    assert q_np.dtype == ml_dtypes.float8_e4m3fn and s_np.dtype == np.float32
    np.testing.assert_array_equal(q_np.view(np.uint8), np.asarray(w_fp8).view(np.uint8))
    np.testing.assert_array_equal(s_np, np.asarray(scale))


def test_quantize_bf16_input_and_all_zero(rng):
    w = jnp.asarray(rng.standard_normal((40, 33)).astype(np.float32)).astype(jnp.bfloat16)
    q, s = quantize_fp8_blocks(w, BLOCK)
    q_np, s_np = quantize_fp8_blocks_np(np.asarray(w), BLOCK)
    np.testing.assert_array_equal(q_np.view(np.uint8), np.asarray(q).view(np.uint8))
    np.testing.assert_array_equal(s_np, np.asarray(s))
    q0, s0 = quantize_fp8_blocks(jnp.zeros((20, 40), jnp.float32), BLOCK)
    assert np.all(np.asarray(s0) == 1.0) and np.all(np.asarray(q0).astype(np.float32) == 0)
    assert np.all(np.asarray(dequantize_fp8_blocks(q0, s0, BLOCK)) == 0)


# ----------------------------------------------------------------------------- dense


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M,K,N,block", [(5, 50, 70, BLOCK), (9, 48, 64, (16, 16)), (1, 37, 19, (8, 32))])
def test_reference_dense(rng, x_dtype, M, K, N, block):
    """Partial edge blocks in K and N; leading axes on x."""
    _, w_fp8, scale = _weights(rng, (K, N), block)
    w64 = deq64(w_fp8, scale, block)
    x, x64 = _x(rng, (2, M, K), x_dtype)
    y = fp8_matmul_reference(x, w_fp8, scale, block=block)
    assert y.shape == (2, M, N) and y.dtype == x_dtype
    _check(y.reshape(2 * M, N), x64.reshape(2 * M, K), w64, _tol(x_dtype))
    y32 = fp8_matmul_reference(x, w_fp8, scale, block=block, out_dtype=jnp.float32)
    assert y32.dtype == jnp.float32


def test_reference_batched_weights(rng):
    _, w_fp8, scale = _weights(rng, (3, 40, 24), BLOCK)
    x, x64 = _x(rng, (3, 4, 40), jnp.float32)
    y = fp8_matmul_reference(x, w_fp8, scale, block=BLOCK)
    w64 = deq64(w_fp8, scale, BLOCK)
    assert y.shape == (3, 4, 24)
    for e in range(3):
        _check(y[e], x64[e], w64[e], 1e-5)


# (M, K, N, kernel options): partial M and N edge tiles; block_n below, equal to and above bn
# (per-column scale vector); K splits.
PALLAS_DENSE = [
    (20, 48, 70, {}),
    (20, 48, 70, dict(block_n=64)),
    (7, 96, 40, dict(block_n=16, split_k=3)),
    (33, 32, 96, dict(block_m=16, block_n=32)),
]


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M,K,N,opts", PALLAS_DENSE)
def test_pallas_dense(rng, x_dtype, M, K, N, opts):
    _, w_fp8, scale = _weights(rng, (K, N), BLOCK)
    w64 = deq64(w_fp8, scale, BLOCK)
    x, x64 = _x(rng, (M, K), x_dtype)
    y = fp8_matmul_pallas_triton(x, w_fp8, scale, block=BLOCK, interpret=True, **opts)
    assert y.shape == (M, N) and y.dtype == x_dtype
    _check(y, x64, w64, _tol(x_dtype))
    if x_dtype == jnp.bfloat16 and not opts:  # bf16 × fp8 products are exact: only fp32 summation remains
        y32 = fp8_matmul_pallas_triton(x, w_fp8, scale, block=BLOCK, out_dtype=jnp.float32, interpret=True)
        assert y32.dtype == jnp.float32
        _check(y32, x64, w64, 1e-5)


def test_dispatch_dense(rng):
    _, w_fp8, scale = _weights(rng, (48, 40), BLOCK)
    x = jnp.asarray(rng.standard_normal((2, 3, 48)).astype(np.float32))
    ref = fp8_matmul_reference(x, w_fp8, scale, block=BLOCK)
    if jax.default_backend() != "gpu":
        assert api.default_implementation() == "xla"
        np.testing.assert_array_equal(np.asarray(api.fp8_matmul(x, w_fp8, scale, block=BLOCK)), np.asarray(ref))
    y = api.fp8_matmul(x, w_fp8, scale, block=BLOCK, interpret=True)  # Pallas, leading axes flattened
    assert y.shape == (2, 3, 40)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    # A partial K block: the Pallas path is skipped (reference) unless explicitly requested.
    _, w2, s2 = _weights(rng, (50, 40), BLOCK)
    x2 = jnp.asarray(rng.standard_normal((3, 50)).astype(np.float32))
    assert "multiple of bk" in unsupported_reason(x2, w2, s2, block=BLOCK, interpret=True)
    np.testing.assert_array_equal(np.asarray(api.fp8_matmul(x2, w2, s2, block=BLOCK, interpret=True)),
                                  np.asarray(fp8_matmul_reference(x2, w2, s2, block=BLOCK)))
    with pytest.raises(NotImplementedError):
        api.fp8_matmul(x2, w2, s2, block=BLOCK, implementation="pallas_triton", interpret=True)
    with pytest.raises(KeyError):
        api.fp8_matmul(x2, w2, s2, block=BLOCK, implementation="cutlass")
    # GPU tile constraints (interpret mode drops them).
    assert "power of two" in unsupported_reason(x.reshape(6, 48), w_fp8, scale, block=BLOCK, block_n=24)
    assert unsupported_reason(x.reshape(6, 48), w_fp8, scale, block=BLOCK) is None
    assert "power of two" in unsupported_reason(x.reshape(6, 48), w_fp8, jax.ShapeDtypeStruct((2, 2), jnp.float32),
                                                block=(24, 32))  # shape structs do
    assert "dtype" in unsupported_reason(x.astype(jnp.float16).reshape(6, 48), w_fp8, scale, block=BLOCK)


# ----------------------------------------------------------------------------- grouped


def _grouped_oracle(x64, w64, sizes):
    out = np.zeros((x64.shape[0], w64.shape[-1]))
    start = 0
    for e, g in enumerate(sizes):
        out[start:start + g] = x64[start:start + g] @ w64[e]
        start += g
    return out


def _check_grouped(got, x64, w64, sizes, tol):
    got = np.asarray(got).astype(np.float64)
    want = _grouped_oracle(x64, w64, sizes)
    bound = _grouped_oracle(np.abs(x64), np.abs(w64), sizes)
    assert np.all(np.abs(got - want) <= tol * bound), np.max(np.abs(got - want) / np.maximum(bound, 1e-30))
    assert np.all(got[sum(sizes):] == 0)  # rows past Σ group_sizes


GROUPS = [(0, 7, 0, 12, 0), (9, 0, 0, 3, 10)]  # empty first / middle / last; Σ < M = 24 in the first


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", GROUPS)
def test_grouped(rng, x_dtype, sizes):
    M, K, N = 24, 32, 40  # N: one full and one partial bn block
    _, w_fp8, scale = _weights(rng, (len(sizes), K, N), BLOCK)
    w64 = deq64(w_fp8, scale, BLOCK)
    x, x64 = _x(rng, (M, K), x_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    ref = fp8_grouped_matmul_reference(x, w_fp8, scale, gs, block=BLOCK)
    assert ref.dtype == jnp.float32 and ref.shape == (M, N)
    # bf16 x: the reference rounds the dequantised weight to bf16 (2^-8); float32 output.
    _check_grouped(ref, x64, w64, sizes, 1e-5 if x_dtype == jnp.float32 else 2.0 ** -8 + 1e-5)
    # block_m = 8: groups of several tiles with a partial last tile; block_n = 16 < bn.
    pal = fp8_grouped_matmul_pallas_triton(x, w_fp8, scale, gs, block=BLOCK, block_m=8, block_n=16, interpret=True)
    assert pal.dtype == jnp.float32
    _check_grouped(pal, x64, w64, sizes, 1e-5)  # exact products (fp8 → bf16 / fp32), fp32 sums


def test_grouped_all_empty_and_dispatch(rng):
    _, w_fp8, scale = _weights(rng, (3, 32, 32), BLOCK)
    x = jnp.asarray(rng.standard_normal((10, 32)).astype(np.float32))
    zero = jnp.zeros((3,), jnp.int32)
    assert np.all(np.asarray(fp8_grouped_matmul_pallas_triton(x, w_fp8, scale, zero, block=BLOCK, interpret=True)) == 0)
    gs = jnp.asarray([4, 0, 5], jnp.int32)
    ref = fp8_grouped_matmul_reference(x, w_fp8, scale, gs, block=BLOCK)
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(np.asarray(api.fp8_grouped_matmul(x, w_fp8, scale, gs, block=BLOCK)),
                                      np.asarray(ref))
    got = api.fp8_grouped_matmul(x, w_fp8, scale, gs, block=BLOCK, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    with pytest.raises(NotImplementedError):  # partial K block
        api.fp8_grouped_matmul(x[:, :30], w_fp8[:, :30], scale, gs, block=BLOCK, implementation="pallas_triton",
                               interpret=True)


def test_tile_metadata_covers_each_row_once(rng):
    """Every row of [0, M) is covered by exactly one tile, of its group's expert (−1 past Σ);
    empty groups get no tile; the static bound cdiv(M, bm) + E always suffices."""
    for M, bm, sizes in [(24, 8, (0, 7, 0, 12, 0)), (16, 16, (16, 0)), (5, 4, (0, 0, 0)), (40, 8, (9, 8, 8, 1, 7)),
                         (30, 4, tuple(rng.multinomial(27, [0.25] * 4)))]:
        meta = jax.jit(tile_metadata, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), M, bm)
        expert, row0, count = (np.asarray(a) for a in meta)
        assert len(expert) == -(-M // bm) + len(sizes)
        owner = np.full(M, -2)
        for e, r, c in zip(expert, row0, count):
            assert 0 <= c <= bm
            assert np.all(owner[r:r + c] == -2)
            owner[r:r + c] = e
        want = np.concatenate([np.full(g, e) for e, g in enumerate(sizes)] + [np.full(M - sum(sizes), -1)])
        np.testing.assert_array_equal(owner, want)
        assert set(expert[count > 0]) <= {e for e, g in enumerate(sizes) if g} | {-1}


# ----------------------------------------------------------------------------- TP / EP shards


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_tensor_parallel_shards(rng, impl):
    """A column (N) shard gives exactly the matching columns; a row (K) shard pair's partial
    products sum to the full result."""
    K, N, block = 64, 96, BLOCK
    _, w_fp8, scale = _weights(rng, (K, N), block)
    x = jnp.asarray(rng.standard_normal((10, K)).astype(np.float32))
    if impl == "xla":
        mm = lambda x, w, s: fp8_matmul_reference(x, w, s, block=block)  # noqa: E731
    else:
        mm = lambda x, w, s: fp8_matmul_pallas_triton(x, w, s, block=block, block_n=32, interpret=True)  # noqa: E731
    full = np.asarray(mm(x, w_fp8, scale))
    a, b = 32, 96  # columns [32, 96): scale blocks 1..2
    cols = np.asarray(mm(x, w_fp8[:, a:b], scale[:, a // block[1]:b // block[1]]))
    np.testing.assert_array_equal(cols, full[:, a:b])
    k = 32  # rows [0, 32) and [32, 64): scale blocks 0..1 and 2..3
    parts = [mm(x[:, :k], w_fp8[:k], scale[:k // block[0]]), mm(x[:, k:], w_fp8[k:], scale[k // block[0]:])]
    x64, w64 = np.asarray(x, np.float64), deq64(w_fp8, scale, block)
    _check(np.asarray(parts[0]) + np.asarray(parts[1]), x64, w64, 1e-5)
    np.testing.assert_allclose(np.asarray(parts[0]) + np.asarray(parts[1]), full, rtol=1e-5,
                               atol=1e-5 * np.abs(full).max())


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_expert_parallel_shard(rng, impl):
    """An EP shard (experts 2..3 with their group sizes and rows) equals those experts' rows of
    the full grouped result."""
    sizes = (5, 0, 6, 4, 3)
    K, N = 32, 40
    _, w_fp8, scale = _weights(rng, (len(sizes), K, N), BLOCK)
    x = jnp.asarray(rng.standard_normal((20, K)).astype(np.float32))
    if impl == "xla":
        gmm = lambda x, w, s, g: fp8_grouped_matmul_reference(x, w, s, g, block=BLOCK)  # noqa: E731
    else:
        gmm = lambda x, w, s, g: fp8_grouped_matmul_pallas_triton(  # noqa: E731
            x, w, s, g, block=BLOCK, block_m=4, interpret=True)
    full = np.asarray(gmm(x, w_fp8, scale, jnp.asarray(sizes, jnp.int32)))
    lo, hi = sum(sizes[:2]), sum(sizes[:4])
    shard = np.asarray(gmm(x[lo:hi], w_fp8[2:4], scale[2:4], jnp.asarray(sizes[2:4], jnp.int32)))
    np.testing.assert_allclose(shard, full[lo:hi], rtol=1e-6, atol=1e-6 * np.abs(full).max())
    if impl == "pallas":  # tiles start at each group's first row: the same tiles, the same bits
        np.testing.assert_array_equal(shard, full[lo:hi])
