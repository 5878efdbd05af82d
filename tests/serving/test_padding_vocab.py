"""Padding ids: the rows of a checkpoint's embedding past its tokenizer (GLM-5.3 154,880 vs
154,856; the tiny checkpoint 512 vs 496) have no text and are never sampled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm53.tiny_checkpoint import default_model_dir
from glm53.tokenizer import GlmTokenizer, tokenizer_vocab_size
from serving.sampling import compute_logprobs, mask_unreachable, sample_tokens


@pytest.fixture(scope="module")
def tok():
    return GlmTokenizer.from_pretrained(default_model_dir())


def test_padding_ids_decode_to_empty_text_and_bytes(tok):
    assert tok.vocab_size == tokenizer_vocab_size(default_model_dir()) == 496
    for i in (496, 500, 511):
        assert tok.is_padding_id(i)
        assert tok.token_bytes(i) == b""
        assert tok.decode([i]) == ""
    assert tok.decode([5, 500, 9]) == tok.decode([5, 9])
    assert not tok.is_padding_id(495) and tok.token_bytes(495) != b""
    with pytest.raises(KeyError, match="negative"):
        tok.token_bytes(-1)


def test_mask_keeps_padding_ids_out_of_sampling_and_logprobs():
    """Padding logits made the largest: greedy, temperature sampling and the top-k logprobs all
    stay below `reachable`, and the logprobs are the log-softmax over the reachable ids (numpy)."""
    rng = np.random.default_rng(0)
    B, V, n = 4, 40, 32
    logits = rng.normal(size=(B, V)).astype(np.float32)
    logits[:, n:] += 10.0  # the padding rows would win everything
    masked = mask_unreachable(jnp.asarray(logits), n)
    sample = jax.jit(sample_tokens)
    greedy = sample(masked, jnp.zeros(B), jnp.ones(B), jnp.arange(B), jnp.zeros(B, jnp.int32))
    np.testing.assert_array_equal(np.asarray(greedy), logits[:, :n].argmax(-1))
    for step in range(20):
        s = sample(masked, jnp.full(B, 2.0), jnp.ones(B), jnp.arange(B), jnp.full(B, step, jnp.int32))
        assert (np.asarray(s) < n).all()
    tok_lp, top_ids, top_lp = compute_logprobs(masked, greedy, k=8)
    assert (np.asarray(top_ids) < n).all()
    x = logits[:, :n].astype(np.float64)
    ref = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(tok_lp), ref.max(-1), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(top_lp), -np.sort(-ref, axis=-1)[:, :8], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(mask_unreachable(jnp.asarray(logits), V)), logits)
