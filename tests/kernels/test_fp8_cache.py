"""FP8 cache formats against an independent numpy codec (ml_dtypes' float8_e4m3fn and bfloat16).

The numpy side quantises with the documented rule (scale = max(amax·fp32(1/448), 2^-126), codes =
e4m3(clip(x/scale, ±448)), value = code·scale) and builds the documented byte strings; the JAX
codecs, page layouts and the references reading fp8 pages are checked against it.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels.indexer_topk.reference import indexer_topk_reference
from kernels.paged import CacheComponent, GroupLayout
from kernels.paged import decode_rows as _decode_rows
from kernels.paged import encode_rows as _encode_rows
from kernels.paged import read_cache as _read_cache
from kernels.paged import write_cache as _write_cache
from kernels.paged import fp8
from kernels.sparse_mla.reference import sparse_mla_reference
from tests.kernels.conftest import scatter_dense

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
encode_rows = jax.jit(_encode_rows, static_argnames=("row_dtype", "rope_dim"))
decode_rows = jax.jit(_decode_rows, static_argnames=("row_dtype", "rope_dim"))
write_cache = jax.jit(_write_cache, static_argnames=("layout", "component", "layer"))
read_cache = jax.jit(_read_cache, static_argnames=("layout", "component", "layer", "stored_basis"))
FLOOR = np.float32(2.0 ** -126)


def np_quant(x):
    """fp32 `[..., n]` quantised with one scale over the last axis → (codes uint8, scale fp32, dequantised)."""
    x = np.asarray(x, np.float32)
    scale = np.maximum(np.abs(x).max(-1) * np.float32(1 / 448), FLOOR).astype(np.float32)
    codes = np.clip(x / scale[..., None], -448, 448).astype(E4M3)
    return codes.view(np.uint8), scale, codes.astype(np.float32) * scale[..., None]


def np_ds_mla(x, A):
    """fp8_ds_mla rows as numpy bytes (documented layout) and their dequantised values."""
    lead = x.shape[:-1]
    codes, scale, deq = np_quant(x[..., :A].reshape(*lead, A // 128, 128))
    rope = np.asarray(x[..., A:], np.float32).astype(BF16)
    raw = np.concatenate([codes.reshape(*lead, A), scale.view(np.uint8).reshape(*lead, -1),
                          rope.view(np.uint8).reshape(*lead, -1)], -1)
    return raw, np.concatenate([deq.reshape(*lead, A), rope.astype(np.float32)], -1)


def as_bytes(words):
    return np.ascontiguousarray(np.asarray(words, np.uint32)).view(np.uint8)  # little-endian host


# ----------------------------------------------------------------------------- codecs

def test_e4m3_decode_all_codes_and_encode_rounding(rng):
    codes = np.arange(256, dtype=np.uint32)
    want = codes.astype(np.uint8).view(E4M3).astype(np.float32)
    got = np.asarray(fp8.e4m3_decode(jnp.asarray(codes)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    # Encoding: normals, subnormals, exact ties and out-of-range values (clipped to ±448).
    y = np.concatenate([rng.standard_normal(2000) * 100, rng.standard_normal(500) * 2.0 ** -8,
                        [448.0, -448.0, 500.0, -1e6, 0.0, -0.0, 2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875]])
    y = y.astype(np.float32)
    got = np.asarray(fp8.e4m3_encode(jnp.asarray(y)))
    np.testing.assert_array_equal(got, np.clip(y, -448, 448).astype(E4M3).view(np.uint8))


def test_bf16_words_layout(rng):
    x = rng.standard_normal((3, 10)).astype(np.float32)
    w = fp8.encode_bf16_words(jnp.asarray(x))
    np.testing.assert_array_equal(as_bytes(w), x.astype(BF16).view(np.uint8).reshape(3, -1))
    np.testing.assert_array_equal(np.asarray(fp8.decode_bf16_words(w)), x.astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(decode_rows(encode_rows(jnp.asarray(x), "bfloat16"), "bfloat16")),
                                  x.astype(BF16).astype(np.float32))


@pytest.mark.parametrize("A, R", [(512, 64), (128, 16)])  # full size (656 B) and the tiny model (164 B)
def test_fp8_ds_mla_bytes_and_roundtrip_bound(rng, A, R):
    x = rng.standard_normal((6, A + R)).astype(np.float32)
    x[0, :128] *= 1e3  # tiles with very different ranges
    x[1, 5] = 300.0  # one outlier in a tile
    x[2, :A] = 0.0  # all-zero tiles
    x[3, :128] *= 1e-6
    words = encode_rows(jnp.asarray(x), "fp8_ds_mla", rope_dim=R)
    assert words.shape == (6, A // 4 + A // 128 + R // 2) and 4 * words.shape[1] == A + 4 * A // 128 + 2 * R
    raw, deq = np_ds_mla(x, A)
    np.testing.assert_array_equal(as_bytes(words), raw)
    got = np.asarray(decode_rows(words, "fp8_ds_mla", rope_dim=R))
    np.testing.assert_array_equal(got, deq)
    # Per-element bound from e4m3's 3 mantissa bits: |err| <= max(2^-4 |x|, 2^-10 · tile scale).
    tiles = x[:, :A].reshape(6, A // 128, 128)
    scale = np.maximum(np.abs(tiles).max(-1) / 448, FLOOR)
    bound = np.maximum(2.0 ** -4 * np.abs(tiles), 2.0 ** -10 * scale[..., None]) * (1 + 2.0 ** -20)
    err = np.abs(got[:, :A].reshape(tiles.shape) - tiles)
    assert np.all(err <= bound)
    assert np.all(got[2, :A] == 0) and np.all(as_bytes(words)[2, A:A + 4 * A // 128].view(np.float32) == FLOOR)
    np.testing.assert_array_equal(got[:, A:], x[:, A:].astype(BF16).astype(np.float32))  # rope: bf16, never fp8


def test_fp8_ds_mla_rejects_a_latent_that_is_not_a_multiple_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        CacheComponent("mla", 1, 96 + 16, "fp8_ds_mla", rope_dim=16)
    with pytest.raises(ValueError, match="even"):
        CacheComponent("mla", 1, 128 + 15, "fp8_ds_mla", rope_dim=15)
    with pytest.raises(ValueError, match="multiple of 4"):
        CacheComponent("indexer", 1, 30, "fp8_per_token")
    with pytest.raises(ValueError, match="power-of-two"):
        write_cache(jnp.zeros((2, 64), jnp.uint32), jnp.ones((1, 12)), jnp.array([4], jnp.int32),
                    GroupLayout("g", 4, (CacheComponent("c", 1, 12, "fp8_per_token_hadamard"),)), "c", 0)


def test_fp8_keys_page_holds_all_keys_then_all_scales(rng):
    """Per (page, layer): the tokens' e4m3 codes first, then their fp32 scales (132 B/token at Dk=128)."""
    Dk, tpp, L = 128, 8, 2
    lay = GroupLayout("idx", tpp, (CacheComponent("indexer", L, Dk, "fp8_per_token"),))
    assert lay.bytes_per_token == L * 132
    keys = (rng.standard_normal((11, Dk)) * rng.uniform(0.01, 10, (11, 1))).astype(np.float32)
    keys[4] = 0.0
    slots = np.array([1 * tpp + o for o in range(8)] + [3 * tpp + 5, 3 * tpp + 0, -1], np.int32)
    arena = write_cache(jnp.zeros((4, lay.words_per_page), jnp.uint32), jnp.asarray(keys), jnp.asarray(slots), lay,
                        "indexer", 1)
    codes, scale, deq = np_quant(keys)
    page = as_bytes(arena).reshape(4, -1)
    layer1 = tpp * (Dk + 4)  # byte offset of layer 1's region
    for i, s in enumerate(slots[:10]):
        blk, o = divmod(int(s), tpp)
        k0 = layer1 + o * Dk
        np.testing.assert_array_equal(page[blk, k0:k0 + Dk], codes[i])
        s0 = layer1 + tpp * Dk + 4 * o
        np.testing.assert_array_equal(page[blk, s0:s0 + 4], scale[i:i + 1].view(np.uint8))
    assert not page[:, :layer1].any() and not page[0].any() and not page[2].any()  # layer 0, null block, unused
    got = np.asarray(read_cache(arena, jnp.asarray(slots[:10]), lay, "indexer", 1))
    np.testing.assert_array_equal(got, deq[:10])
    bound = np.maximum(2.0 ** -4 * np.abs(keys[:10]), 2.0 ** -10 * scale[:10, None]) * (1 + 2.0 ** -20)
    assert np.all(np.abs(got - keys[:10]) <= bound)


# ----------------------------------------------------------------------------- Hadamard

def test_hadamard_rotation_keeps_scores_up_to_fp8_error(rng):
    H = fp8.hadamard_matrix(32)
    np.testing.assert_allclose(H @ H, np.eye(32), atol=1e-6)
    np.testing.assert_array_equal(H, H.T)
    Dk, tpp = 32, 4
    keys = rng.standard_normal((16, Dk)).astype(np.float32)
    q = rng.standard_normal((5, Dk)).astype(np.float32)
    slots = jnp.arange(tpp, tpp + 16, dtype=jnp.int32)
    exact = q.astype(np.float64) @ keys.T.astype(np.float64)
    for rd in ("fp8_per_token", "fp8_per_token_hadamard"):
        lay = GroupLayout("i", tpp, (CacheComponent("c", 1, Dk, rd),))
        arena = write_cache(jnp.zeros((6, lay.words_per_page), jnp.uint32), jnp.asarray(keys), slots, lay, "c", 0)
        stored = np.asarray(read_cache(arena, slots, lay, "c", 0, stored_basis=True))
        # The project's own rotation (XLA's matmul): numpy's BLAS may round `keys @ H` differently
        # in the last bit on some CPUs, and a one-ulp difference can move an e4m3 rounding.
        rot = np.asarray(fp8.hadamard_rotate(jnp.asarray(keys))) if rd.endswith("hadamard") else keys
        np.testing.assert_allclose(rot, keys @ H if rd.endswith("hadamard") else keys, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(stored, np_quant(rot)[2])  # the quantised (rotated) keys
        qb = q @ H if rd.endswith("hadamard") else q  # queries rotated by the same H
        scores = qb.astype(np.float64) @ stored.T.astype(np.float64)
        # Bound: |q·(k̂ − k)| <= Σ|q_i|·max(2^-4|k_i|, 2^-10 s) in the stored basis.
        s = np.maximum(np.abs(rot).max(-1) / 448, FLOOR)
        bound = np.abs(qb) @ np.maximum(2.0 ** -4 * np.abs(rot), 2.0 ** -10 * s[:, None]).T
        assert np.all(np.abs(scores - exact) <= bound * 1.001 + 1e-4)
        if rd.endswith("hadamard"):  # unrotated queries against rotated keys give unrelated scores
            assert np.abs(q.astype(np.float64) @ stored.T - exact).max() > 5 * bound.max()
        # read_cache undoes the rotation: values close to the original keys.
        np.testing.assert_allclose(np.asarray(read_cache(arena, slots, lay, "c", 0)), stored @ H if rd.endswith(
            "hadamard") else stored, atol=1e-4)


# ----------------------------------------------------------------------------- references on fp8 pages

def test_sparse_mla_on_fp8_ds_mla_pages_matches_dense_on_dequantised_rows(rng):
    A, R, N, tpp = 128, 16, 3, 4
    lay = GroupLayout("m", tpp, (CacheComponent("c", 2, A + R, "fp8_ds_mla", rope_dim=R),))
    seqs = [rng.standard_normal((n, A + R)).astype(np.float32) for n in (5, 11)]
    arena, _, slots = scatter_dense(lay, 10, seqs, 1, rng)
    T, K = 5, 6
    req = np.array([0, 0, 1, 1, 1])
    topk = np.full((T, K), -1, np.int32)
    for t in range(T):
        n = len(seqs[req[t]])
        pick = rng.choice(n, size=min(K - 1, n), replace=False)
        topk[t, :len(pick)] = slots[req[t]][pick]
    topk[4] = -1  # an empty row
    topk[3, 0] = 1  # a null-block slot counts as absent
    q = rng.standard_normal((T, N, A + R)).astype(np.float32)
    o, lse = sparse_mla_reference(jnp.asarray(q), arena, jnp.asarray(topk), 1, layout=lay, component="c",
                                  kv_lora_rank=A, scale=0.1, t_chunk=2)
    o, lse = np.asarray(o), np.asarray(lse)
    for t in range(4):
        deq = np_ds_mla(seqs[req[t]], A)[1].astype(np.float64)
        where = {int(s): i for i, s in enumerate(slots[req[t]])}
        rows = deq[[where[int(s)] for s in topk[t] if int(s) in where]]
        sc = q[t].astype(np.float64) @ rows.T * 0.1
        m = sc.max(-1, keepdims=True)
        p = np.exp(sc - m)
        np.testing.assert_allclose(o[t], (p / p.sum(-1, keepdims=True)) @ rows[:, :A], atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(lse[t], m[:, 0] + np.log(p.sum(-1)), atol=2e-5, rtol=1e-5)
    assert np.all(np.isneginf(lse[4])) and np.all(o[4] == 0) and not np.isnan(o).any()


@pytest.mark.parametrize("row_dtype", ["fp8_per_token", "fp8_per_token_hadamard"])
def test_indexer_on_fp8_keys_matches_dense_on_dequantised_keys(rng, row_dtype):
    I, Dk, tpp = 3, 32, 4
    lay = GroupLayout("i", tpp, (CacheComponent("c", 1, Dk, row_dtype),))
    lens = (10, 3, 17)
    keys = [rng.standard_normal((n, Dk)).astype(np.float32) for n in lens]
    arena, bt, _ = scatter_dense(lay, 16, keys, 0, rng)
    bt[2, 1] = 0  # positions 4..7 of request 2 live in the null block: never selected
    req = np.array([0, 0, 1, 2, 2, 2], np.int32)
    pos = np.array([9, 4, 2, 16, 0, 10], np.int32)
    q = rng.standard_normal((6, I, Dk)).astype(np.float32)
    w = rng.standard_normal((6, I)).astype(np.float32)
    K = 6
    idx, valid = indexer_topk_reference(jnp.asarray(q), jnp.asarray(w), arena, jnp.asarray(bt), jnp.asarray(req),
                                        jnp.asarray(pos), 0, layout=lay, component="c", topk=K, t_chunk=4,
                                        s_chunk=8, s_block=4)
    H = fp8.hadamard_matrix(Dk).astype(np.float64) if row_dtype.endswith("hadamard") else np.eye(Dk)
    for t in range(6):
        k = np_quant(keys[req[t]] @ H.astype(np.float32))[2].astype(np.float64)  # stored keys
        s = np.maximum((q[t].astype(np.float64) @ H) @ k.T, 0)
        score = (w[t][:, None] * s).sum(0) * Dk ** -0.5
        ok = [j for j in range(pos[t] + 1) if bt[req[t], j // tpp] > 0]
        want = sorted(ok, key=lambda j: (-score[j], j))[:K]
        assert idx[t].tolist() == want + [-1] * (K - len(want)), t
        assert valid[t] == len(want)
