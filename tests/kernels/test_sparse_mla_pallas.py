"""Pallas sparse MLA (interpret mode) against the reference and dense numpy maths; dispatch rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.sparse_mla import api
from kernels.sparse_mla.pallas_triton import sparse_mla_pallas_triton
from kernels.sparse_mla.reference import sparse_mla_reference
from tests.kernels.conftest import make_layout, scatter_dense

A, R = 16, 8  # lane widths stay powers of two for both row dtypes (A/2 = 8, R/2 = 4)


def _case(rng, row_dtype, N=20, K=20):
    """Three requests of 3, 9, 13 tokens in shuffled pages; 5 query tokens with ragged picks,
    −1 padding, one all-empty row and one null-block slot."""
    lay = make_layout(A + R, num_layers=2, tpp=4, row_dtype=row_dtype)
    seqs = [rng.standard_normal((n, A + R)).astype(np.float32) for n in (3, 9, 13)]
    arena, _, slots = scatter_dense(lay, 12, seqs, 1, rng)
    req = np.array([0, 1, 2, 2, 1])
    topk = np.full((len(req), K), -1, np.int32)
    for t, b in enumerate(req):
        n = len(seqs[b])
        pick = rng.choice(n, size=min(K - 1, n), replace=False)
        topk[t, rng.choice(K, size=len(pick), replace=False)] = slots[b][pick]  # −1 scattered among rows
    topk[3, :] = -1  # nothing selected
    topk[4, 0] = 2  # a slot inside the null block counts as absent
    q = rng.standard_normal((len(req), N, A + R)).astype(np.float32)
    return lay, seqs, arena, slots, req, jnp.asarray(topk), jnp.asarray(q)


def _dense(q_NC, rows_KC, scale):
    s = q_NC.astype(np.float64) @ rows_KC.T.astype(np.float64) * scale
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return e @ rows_KC[:, :A] / e.sum(-1, keepdims=True), (m[:, 0] + np.log(e.sum(-1)))


@pytest.mark.parametrize("row_dtype", ["float32", "bfloat16"])
def test_matches_reference_and_dense_maths(rng, row_dtype):
    lay, seqs, arena, slots, req, topk, q = _case(rng, row_dtype)
    layer = jnp.int32(1)  # traced layer index
    kw = dict(layout=lay, component="c", kv_lora_rank=A, scale=0.3)
    # K = 20 → two blocks of 16; 20 heads → two head blocks; two key splits of one block each, so
    # the log-sum-exp combine is exercised too.
    o, lse = sparse_mla_pallas_triton(q, arena, topk, layer, **kw, block_k=16, block_h=16, num_splits=2,
                                      interpret=True)
    o_ref, lse_ref = sparse_mla_reference(q, arena, topk, layer, **kw)
    o, lse = np.asarray(o), np.asarray(lse)
    assert o.shape == (5, 20, A) and lse.shape == (5, 20)
    np.testing.assert_allclose(o, np.asarray(o_ref), atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(lse, np.asarray(lse_ref), atol=2e-6, rtol=2e-6)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(np.isneginf(lse[3])) and np.all(o[3] == 0)
    topk = np.asarray(topk)
    for t in (0, 1, 2, 4):  # independent check: dense float64 softmax over the stored rows
        s = np.asarray(jnp.asarray(seqs[req[t]]).astype(jnp.bfloat16).astype(jnp.float32)) \
            if row_dtype == "bfloat16" else seqs[req[t]]
        where = {int(x): i for i, x in enumerate(slots[req[t]])}
        rows = np.stack([s[where[int(x)]] for x in topk[t] if int(x) in where])
        o_d, lse_d = _dense(np.asarray(q[t]), rows, 0.3)
        np.testing.assert_allclose(o[t], o_d, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lse[t], lse_d, atol=1e-5, rtol=1e-5)


def test_bf16_precision_path_is_close(rng):
    """Tensor-core path: bf16 queries and probabilities, fp32 accumulation (~1e-2 relative)."""
    lay, _, arena, _, _, topk, q = _case(rng, "bfloat16", N=16, K=16)
    kw = dict(layout=lay, component="c", kv_lora_rank=A, scale=0.3)
    o, lse = sparse_mla_pallas_triton(q, arena, topk, 1, **kw, block_k=16, block_h=16, precision="bf16",
                                      interpret=True)
    o_ref, lse_ref = sparse_mla_reference(q.astype(jnp.bfloat16), arena, topk, 1, **kw)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=2e-2, rtol=2e-2)
    assert np.all(np.isneginf(np.asarray(lse)[3]))


def test_same_rows_elsewhere_give_bit_identical_output(rng):
    """HiSparse reads a row from a hot slot instead of its page: the output must not change."""
    lay = make_layout(A + R, num_layers=1, tpp=4)
    kv = rng.standard_normal((8, A + R)).astype(np.float32)
    arena1, _, s1 = scatter_dense(lay, 8, [kv], 0, np.random.default_rng(1))
    arena2, _, s2 = scatter_dense(lay, 8, [kv], 0, np.random.default_rng(2))
    assert not np.array_equal(s1[0], s2[0])
    q = jnp.asarray(rng.standard_normal((2, 16, A + R)).astype(np.float32))
    pick = np.array([[5, 1, 7, -1] * 4, [0, 2, 3, 6] * 4])
    kw = dict(layout=lay, component="c", kv_lora_rank=A, scale=0.2, block_k=16, block_h=16, num_splits=1,
              interpret=True)
    t1 = jnp.asarray(np.where(pick >= 0, s1[0][pick], -1).astype(np.int32))
    t2 = jnp.asarray(np.where(pick >= 0, s2[0][pick], -1).astype(np.int32))
    o1, l1 = sparse_mla_pallas_triton(q, arena1, t1, 0, **kw)
    o2, l2 = sparse_mla_pallas_triton(q, arena2, t2, 0, **kw)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


def test_dispatch(rng):
    lay, _, arena, _, _, topk, q = _case(rng, "float32", N=4, K=8)
    kw = dict(layout=lay, component="c", kv_lora_rank=A, scale=0.3)
    assert api.default_implementation() == ("pallas_triton" if jax.default_backend() == "gpu" else "xla")
    ref = sparse_mla_reference(q, arena, topk, 1, **kw)
    auto = api.sparse_mla(q, arena, topk, 1, **kw)  # CPU: the reference itself
    for a, b in zip(auto, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pal = api.sparse_mla(q, arena, topk, 1, **kw, interpret=True)
    np.testing.assert_allclose(np.asarray(pal[0]), np.asarray(ref[0]), atol=2e-6, rtol=2e-6)
    # A latent width whose lanes are not a power of two: the Pallas kernel refuses it...
    lay12 = make_layout(12 + R, num_layers=2, tpp=4)
    kw12 = dict(layout=lay12, component="c", kv_lora_rank=12, scale=0.3)
    q12 = q[..., 4:]
    with pytest.raises(NotImplementedError, match="power of two"):
        api.sparse_mla(q12, arena, topk, 1, **kw12, implementation="pallas_triton", interpret=True)
    # ...and the default dispatch falls back to the reference.
    fb = api.sparse_mla(q12, arena, topk, 1, **kw12, interpret=True)
    for a, b in zip(fb, sparse_mla_reference(q12, arena, topk, 1, **kw12)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prefill_with_every_key_selected_is_dense_causal_attention(rng):
    """A 10-token prompt whose top-k lists hold every causal key (K = 16 ≥ 10): the Pallas kernel
    must equal dense causal softmax attention (float64 numpy) over the stored bf16 rows."""
    lay = make_layout(A + R, num_layers=1, tpp=4, row_dtype="bfloat16")
    S = 10
    kv = rng.standard_normal((S, A + R)).astype(np.float32)
    arena, _, slots = scatter_dense(lay, 6, [kv], 0, rng)
    kv = np.asarray(jnp.asarray(kv).astype(jnp.bfloat16).astype(jnp.float32))
    q = rng.standard_normal((S, 16, A + R)).astype(np.float32)
    topk = np.array([[slots[0][s] if s <= t else -1 for s in range(16)] for t in range(S)], np.int32)
    o, lse = sparse_mla_pallas_triton(jnp.asarray(q), arena, jnp.asarray(topk), 0, layout=lay, component="c",
                                      kv_lora_rank=A, scale=0.5, block_k=16, block_h=16, interpret=True)
    s = np.einsum("tnc,sc->tns", q.astype(np.float64), kv) * 0.5
    s = np.where(np.tril(np.ones((S, S), bool))[:, None, :], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    np.testing.assert_allclose(np.asarray(o), (p / p.sum(-1, keepdims=True)) @ kv[:, :A], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), m[..., 0] + np.log(p.sum(-1)), atol=1e-5, rtol=1e-5)
