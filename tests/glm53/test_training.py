"""The training-mode forward (glm53/training.py) against the serving forward, and the DSA recipe's
gradient separation.

The independent result is the serving path (`glm53.api.forward`: paged arena, the indexer top-k
kernel reference, absorbed sparse MLA over the selected rows) on the random tiny checkpoint's
7-layer twin (tests/helpers/shallow_model.py: a one-layer, a mixed and two stacked IndexShare
groups, dense and MoE layers, as the 14-layer checkpoint has)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm53 import api
from glm53.training import topk_mask, train_forward

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model


@pytest.fixture(scope="module")
def lm():
    return api.load(dtype=jnp.float32, cache_dtype="float32")


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, 490, n).tolist()


def test_sparse_training_forward_equals_serving_forward(lm):
    """A 150-token sequence (> index_topk 64): the DSA-sparse training forward selects the same
    top-k as the serving indexer and attends to the same rows; logits agree to fp32 rounding.

    The random checkpoint's indexer scores have near-ties at the top-k boundary (ReLU of random
    dot products; the two paths sum in different orders), and a query whose 64th and 65th keys
    swap attends to one different row from then on (layer 0 selects identically; later layers
    see inputs that differ by rounding): at most 4 % of the rows may differ, none of the first 64."""
    ids = _ids(150, 0)
    ref = np.asarray(api.forward(lm, ids))
    graphdef, state = nnx.split(lm.model)

    @partial(jax.jit, static_argnums=1)  # one program each: eagerly, every op compiles on its own
    def logits(state, sparse):
        return train_forward(nnx.merge(graphdef, state), jnp.asarray([ids]), sparse=sparse, mtp=False).logits_BTV[0]

    got = np.asarray(logits(state, True))
    tol = 2e-4 * np.abs(ref).max()
    bad = np.abs(got - ref).max(-1) > tol
    assert bad.sum() <= 6, np.nonzero(bad)
    assert not bad[:64].any()
    dense = np.asarray(logits(state, False))
    # Dense attention differs from the served (sparse) model once a query sees > index_topk keys.
    assert np.abs(dense[100:] - ref[100:]).max() > 1e-3
    np.testing.assert_allclose(dense[:64], ref[:64], atol=2e-4 * np.abs(ref).max())


def test_topk_mask_tie_rule_and_short_rows():
    scores = jnp.asarray([[[0, 0, 0, 0], [1, 1, 0, 0], [2, 2, 2, 0], [5, 1, 5, 5]]], jnp.float32)
    causal = jnp.tril(jnp.ones((4, 4), bool))
    m = np.asarray(topk_mask(scores, causal, 2))[0]
    # Rows with ≤ 2 visible keys keep all of them; ties go to the lower position.
    assert m.tolist() == [[True, False, False, False], [True, True, False, False],
                          [True, True, False, False], [True, False, True, False]]


def test_indexer_trains_only_on_kl_and_model_only_on_lm(lm):
    """DeepSeek-V3.2's separation: the indexer's inputs are detached, so the language-model loss
    gives the indexer no gradient and the KL loss gives the rest of the model none."""
    graphdef, params = nnx.split(lm.model, nnx.Param)
    ids = jnp.asarray([_ids(96, 1)])

    def loss(p, which):
        out = train_forward(nnx.merge(graphdef, p), ids, sparse=True, mtp=True)
        if which == "kl":
            return out.indexer_kl
        logp = jax.nn.log_softmax(out.logits_BTV[0, :-1])
        return -jnp.take_along_axis(logp, ids[0, 1:, None], -1).mean() - jax.nn.log_softmax(
            out.mtp_logits_BTV[0, :-2])[jnp.arange(94), ids[0, 2:]].mean()

    # One program each: run eagerly, the backward pass dispatches (and compiles) op by op.
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_lm = grad(params, "lm")
    g_kl = grad(params, "kl")

    def norms(g):
        return {jax.tree_util.keystr(k): float(jnp.abs(v).max()) for k, v in jax.tree_util.tree_leaves_with_path(g)}

    nl, nk = norms(g_lm), norms(g_kl)
    idx = [k for k in nl if "'indexer'" in k]
    assert len(idx) >= 5 and all(nl[k] == 0 for k in idx)
    assert all(nk[k] == 0 for k in nk if "'indexer'" not in k)
    assert all(nk[k] > 0 for k in idx if "k_norm" not in k)
    # The LM + MTP losses do reach the head and the MTP layer's own projections.
    heads = [k for k in nl if "lm_head" in k or "eh_proj" in k or "['mtp']['block']['self_attn']['o_proj']" in k]
    assert len(heads) == 3 and all(nl[k] > 0 for k in heads), heads
