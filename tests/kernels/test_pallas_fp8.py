"""Pallas kernels (interpret mode) reading fp8 pages directly: sparse MLA on `fp8_ds_mla` rows and
the indexer on per-token-scaled fp8 keys (plain and Hadamard), against the references (which
dequantise with the cache's own decoder) and dense numpy maths over the stored values; the
indexer's `return_scores`; the fp8 lane codecs against the cache's decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.indexer_topk import api as indexer_api
from kernels.indexer_topk.pallas_triton import indexer_topk_pallas_triton
from kernels.indexer_topk.reference import indexer_topk_reference
from kernels.paged import CacheComponent, GroupLayout, decode_rows, encode_rows
from kernels.pallas_rows import from_lanes, key_row_codec, mla_row_codec
from kernels.sparse_mla.pallas_triton import sparse_mla_pallas_triton
from kernels.sparse_mla.reference import sparse_mla_reference
from tests.kernels.conftest import make_layout, scatter_dense

A, R = 256, 16  # two 128-value scale tiles (the smallest fp8_ds_mla latent with a per-tile select)
I, DK = 4, 16


@jax.jit(static_argnums=(1, 2))
def _roundtrip(x, row_dtype, rope_dim):
    return decode_rows(encode_rows(x, row_dtype, rope_dim), row_dtype, rope_dim)


def _stored(x, row_dtype, rope_dim=0):
    """The values a row dtype stores for x (the cache's own encode/decode, as one program)."""
    return np.asarray(_roundtrip(jnp.asarray(x), row_dtype, rope_dim))


def test_fp8_codecs_give_the_stored_values_in_lane_order(rng):
    x = rng.standard_normal((5, A + R)).astype(np.float32) * np.linspace(0.1, 30, A + R, dtype=np.float32)
    words = np.asarray(encode_rows(jnp.asarray(x), "fp8_ds_mla", R))
    codec = mla_row_codec("fp8_ds_mla", A, R)
    pieces = [jnp.asarray(words[:, o:o + n]) for _, o, n in codec.segments]
    lat, rope = jax.jit(codec.decode)(*pieces)
    want = _stored(x, "fp8_ds_mla", R)
    np.testing.assert_array_equal(np.asarray(from_lanes(lat)), want[:, :A])
    np.testing.assert_array_equal(np.asarray(from_lanes(rope)), want[:, A:])
    k = rng.standard_normal((5, DK)).astype(np.float32)
    kw = np.asarray(encode_rows(jnp.asarray(k), "fp8_per_token"))  # logical row [codes | scale]
    (lanes,) = jax.jit(key_row_codec("fp8_per_token", DK).decode)(jnp.asarray(kw[:, :DK // 4]), jnp.asarray(kw[:, -1:]))
    np.testing.assert_array_equal(np.asarray(from_lanes(lanes)), _stored(k, "fp8_per_token"))


def _dense(q_NC, rows_KC, scale):
    s = q_NC.astype(np.float64) @ rows_KC.T.astype(np.float64) * scale
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return e @ rows_KC[:, :A] / e.sum(-1, keepdims=True), (m[:, 0] + np.log(e.sum(-1)))


def test_sparse_mla_reads_fp8_ds_mla_pages(rng):
    """Three requests (3, 9, 13 tokens) in shuffled pages; ragged picks with −1 among them, an
    all-empty row, a null-block slot; two key splits (log-sum-exp combine)."""
    lay = GroupLayout("g", 4, (CacheComponent("c", 2, A + R, "fp8_ds_mla", rope_dim=R),))
    seqs = [(rng.standard_normal((n, A + R)) * rng.uniform(0.1, 8, (n, 1))).astype(np.float32) for n in (3, 9, 13)]
    arena, _, slots = scatter_dense(lay, 12, seqs, 1, rng)
    req = np.array([0, 1, 2, 2, 1])
    K = 20
    topk = np.full((len(req), K), -1, np.int32)
    for t, b in enumerate(req):
        n = len(seqs[b])
        pick = rng.choice(n, size=min(K - 1, n), replace=False)
        topk[t, rng.choice(K, size=len(pick), replace=False)] = slots[b][pick]
    topk[3, :] = -1
    topk[4, 0] = 2  # inside the null block
    q = jnp.asarray(rng.standard_normal((len(req), 16, A + R)).astype(np.float32) * 0.1)
    kw = dict(layout=lay, component="c", kv_lora_rank=A, scale=0.2)
    o, lse = sparse_mla_pallas_triton(q, arena, jnp.asarray(topk), jnp.int32(1), **kw, block_k=16, block_h=16,
                                      num_splits=2, interpret=True)
    o_ref, lse_ref = sparse_mla_reference(q, arena, jnp.asarray(topk), 1, **kw)
    o, lse = np.asarray(o), np.asarray(lse)
    np.testing.assert_allclose(o, np.asarray(o_ref), atol=2e-5, rtol=2e-5)  # rows up to ~30
    np.testing.assert_allclose(lse, np.asarray(lse_ref), atol=2e-5, rtol=2e-5)
    assert np.all(np.isneginf(lse[3])) and np.all(o[3] == 0) and not np.isnan(o).any()
    for t in (0, 1, 2, 4):  # independent: float64 softmax over the stored (dequantised) rows
        stored = _stored(seqs[req[t]], "fp8_ds_mla", R)
        where = {int(x): i for i, x in enumerate(slots[req[t]])}
        rows = np.stack([stored[where[int(x)]] for x in topk[t] if int(x) in where])
        o_d, lse_d = _dense(np.asarray(q[t]), rows, 0.2)
        np.testing.assert_allclose(o[t], o_d, atol=3e-5, rtol=3e-5)
        np.testing.assert_allclose(lse[t], lse_d, atol=1e-5, rtol=1e-5)


def oracle(q, w, keys, pos, K):
    s = np.einsum("id,sd->is", q.astype(np.float64), keys[: pos + 1].astype(np.float64))
    score = (w[:, None] * np.maximum(s, 0)).sum(0) * DK ** -0.5
    order = sorted(range(pos + 1), key=lambda j: (-score[j], j))[:K]
    return order + [-1] * (K - len(order)), [score[j] for j in order]


def _sylvester(n):
    """Normalised Sylvester Hadamard matrix, built here in float64 (independent of the cache code)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


PALLAS = dict(t_chunk=4, s_chunk=32, block_s=16, interpret=True)


def _indexer_case(rng, row_dtype, integer):
    """Requests of 10, 3, 40 tokens; 6 ragged query tokens; page 1 of request 2 mapped to the null block.

    Integer keys in [−7, 7] with one ±7 per key quantise exactly (scale 7/448 = 2^-6 and every
    64·x is an e4m3 value), so with integer queries every score is exact in fp32 in any order
    and the selections, ties included, must be identical."""
    lay = make_layout(DK, num_layers=2, tpp=4, row_dtype=row_dtype)
    if integer:
        def draw_keys(n):
            k = rng.integers(-2, 3, (n, DK)).astype(np.float32)
            k[np.arange(n), rng.integers(0, DK, n)] = rng.choice([-7.0, 7.0], n)
            return k
        draw = lambda *s: rng.integers(-3, 4, s).astype(np.float32)  # noqa: E731
    else:
        draw_keys = lambda n: rng.standard_normal((n, DK)).astype(np.float32)  # noqa: E731
        draw = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    keys = [draw_keys(n) for n in (10, 3, 40)]
    arena, bt, _ = scatter_dense(lay, 20, keys, 1, rng)
    bt = bt.copy()
    bt[2, 1] = 0  # positions 4..7 of request 2: null block, never selected
    stored = [_stored(k, row_dtype) for k in keys]
    if integer:
        for k, s in zip(keys, stored):
            np.testing.assert_array_equal(s, k)  # exact quantisation (the premise above)
    req = np.array([0, 0, 1, 2, 2, 2], np.int32)
    pos = np.array([9, 4, 2, 39, 0, 21], np.int32)
    args = (jnp.asarray(draw(6, I, DK)), jnp.asarray(draw(6, I)), arena, jnp.asarray(bt), jnp.asarray(req),
            jnp.asarray(pos), 1)
    return lay, stored, bt, req, pos, args


# K = 9: S = K + 1 (pos 9) and S < K (pos 4, 2); K = 10: S = K (pos 9).
@pytest.mark.parametrize("row_dtype,integer,K", [("fp8_per_token", True, 9), ("fp8_per_token_hadamard", False, 10)])
def test_indexer_reads_fp8_keys(rng, row_dtype, integer, K):
    lay, stored, bt, req, pos, args = _indexer_case(rng, row_dtype, integer)
    ref = [np.asarray(x) for x in indexer_topk_reference(*args, layout=lay, component="c", topk=K, return_scores=True)]
    pal = [np.asarray(x) for x in indexer_topk_pallas_triton(*args, layout=lay, component="c", topk=K,
                                                              return_scores=True, **PALLAS)]
    np.testing.assert_array_equal(pal[0], ref[0])
    np.testing.assert_array_equal(pal[1], ref[1])
    np.testing.assert_allclose(pal[2], ref[2], rtol=1e-6, atol=1e-6)
    q, w = np.asarray(args[0]), np.asarray(args[1])
    for t in range(6):  # independent: float64 numpy over the visible stored keys (the rotation cancels)
        b = req[t]
        vis = [s for s in range(pos[t] + 1) if bt[b, s // 4] > 0]
        qt = q[t] if row_dtype == "fp8_per_token" else q[t] @ _sylvester(DK)  # stored keys are k·H
        order, scores = oracle(qt, w[t], stored[b][vis], len(vis) - 1, K)
        want = [vis[j] if j >= 0 else -1 for j in order]
        if integer:
            assert pal[0][t].tolist() == want, t
        np.testing.assert_allclose(pal[2][t][: len(scores)], scores, rtol=1e-5, atol=1e-5)
        assert pal[1][t] == min(K, len(vis))


def test_dispatch_return_scores_uses_pallas(rng):
    """`return_scores` no longer forces the reference: the interpret-mode Pallas result (ties at
    exactly equal integer scores) is returned, equal to the reference's, for bf16 keys too."""
    for row_dtype in ("bfloat16", "fp8_per_token"):
        lay, _, _, _, _, args = _indexer_case(rng, row_dtype, True)
        kw = dict(layout=lay, component="c", topk=8)
        got = indexer_api.indexer_topk(*args, **kw, return_scores=True, interpret=True)
        ref = indexer_topk_reference(*args, **kw, return_scores=True)
        assert len(got) == 3
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        explicit = indexer_api.indexer_topk(*args, **kw, return_scores=True, implementation="pallas_triton",
                                            interpret=True)
        np.testing.assert_array_equal(np.asarray(explicit[2]), np.asarray(ref[2]))


@pytest.mark.parametrize("n_best", [0, 5, 8])
def test_threshold_merge_selects_exactly_what_the_full_sort_does(rng, n_best):
    """The indexer's chunk merge against a numpy lexsort oracle on (higher score, lower position):
    integer chunk scores (many ties, −inf gaps) after a running best of n_best tied entries. With a
    full running best (n_best = K) its score (−1, 9.5, 11 for the three row pairs) puts each pair
    in a different tier: full sort, the s_chunk/4 buffer, the s_chunk/16 buffer (each call is one
    pair, the tier being chosen per call)."""
    from kernels.indexer_topk.pallas_triton import _BIG, _merge, merge_caps

    K, S = 8, 64
    caps = merge_caps(S, K)
    assert caps == (4, 16)
    merge = jax.jit(_merge, static_argnums=(4, 5))
    pos_S = 100 + np.arange(S, dtype=np.int32)
    tiers = []
    for v in (-1.0, 9.5, 11.0):
        best_neg = np.full((2, K), np.inf, np.float32)
        best_pos = np.full((2, K), _BIG, np.int32)
        best_neg[:, :n_best] = -v
        best_pos[:, :n_best] = np.sort(rng.choice(100, (2, n_best)), axis=-1) if n_best else best_pos[:, :0]
        score = rng.integers(0, 12, (2, S)).astype(np.float32)
        score[rng.random((2, S)) < 0.2] = -np.inf
        got_n, got_p = (np.asarray(x) for x in merge(jnp.asarray(best_neg), jnp.asarray(best_pos), jnp.asarray(score),
                                                     jnp.asarray(pos_S), K, caps))
        for r in range(2):
            ok = score[r] > -np.inf
            sc = np.concatenate([-best_neg[r, :n_best], score[r, ok]])
            ps = np.concatenate([best_pos[r, :n_best], pos_S[ok]])
            order = np.lexsort((ps, -sc))[:K]
            assert got_p[r, :len(order)].tolist() == ps[order].tolist()
            np.testing.assert_array_equal(got_n[r, :len(order)], -sc[order])
            assert np.all(got_p[r, len(order):] == _BIG)
        n_cand = int(np.max(np.sum(-score < best_neg[:, K - 1:K], axis=-1)))
        tiers.append(int(n_cand > caps[0]) + int(n_cand > caps[1]))
    assert tiers == ([2, 1, 0] if n_best == K else [2, 2, 2])
