"""`glm53.api.generate_batch`: one jit-compiled program (prefill + `lax.while_loop` decode) for a
ragged batch, checked against the per-token Python loop of `api.generate` run one prompt at a time."""

from __future__ import annotations

import pytest

from glm53 import api

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

PROMPTS = [list(range(5, 10)), [(7 * i) % 300 + 4 for i in range(30)], [(13 * i) % 400 + 4 for i in range(90)]]
N = 10


@pytest.fixture(scope="module")
def lm():
    return api.load()


def test_greedy_batch_equals_one_by_one(lm):
    out = api.generate_batch(lm, PROMPTS, N)
    assert out.token_ids.shape == (3, 90 + N)
    for b in (0, 2):  # the shortest and the longest row (each one-by-one run compiles its own programs)
        p = PROMPTS[b]
        want = api.generate(lm, p, N)
        assert out.new_token_ids[b] == want  # sparse selection included: 90 > index_topk = 64
        assert out.sequences[b] == p + want
        assert list(out.token_ids[b, : len(p)]) == p and (out.token_ids[b, len(p) + N:] == out.pad_id).all()
    assert list(out.num_new) == [N] * 3


def test_eos_ends_a_row_and_pads_it(lm):
    ref = api.generate_batch(lm, PROMPTS, N)
    eos = ref.new_token_ids[1][3]  # row 1's 4th token becomes an EOS id
    out = api.generate_batch(lm, PROMPTS, N, eos_token_ids=eos, pad_id=-1)  # one id, or a list of them
    for b in range(3):
        r = ref.new_token_ids[b]
        stop = r.index(eos) + 1 if eos in r else N
        assert out.new_token_ids[b] == r[:stop] and out.num_new[b] == stop
        assert (out.token_ids[b, len(PROMPTS[b]) + stop:] == -1).all()


def test_sampling_depends_on_the_seed_only(lm):
    a = api.generate_batch(lm, PROMPTS, N, temperature=0.9, top_p=0.95, seed=3)
    b = api.generate_batch(lm, PROMPTS, N, temperature=0.9, top_p=0.95, seed=3)
    c = api.generate_batch(lm, PROMPTS, N, temperature=0.9, top_p=0.95, seed=4)
    assert a.new_token_ids == b.new_token_ids != c.new_token_ids
    assert max(t for row in a.new_token_ids for t in row) < 496  # the tokenizer's ids only (vocab padded to 512)


def test_bad_arguments(lm):
    with pytest.raises(ValueError):
        api.generate_batch(lm, [[1, 2], []], 4)
    with pytest.raises(ValueError):
        api.generate_batch(lm, [[1, 2]], 0)
    # Refused before any program runs, as the engine refuses them (the embedding lookup would
    # clamp an id outside the vocabulary silently: generate returned [0, 0, 0] for [1, 2, 10**6])
    vocab = lm.config.vocab_size
    for call, match in (
        (lambda: api.generate(lm, [1, 2, 10**6], 3), "1000000 is outside the vocabulary"),
        (lambda: api.generate(lm, [1, 2, vocab], 3), f"{vocab} is outside the vocabulary"),
        (lambda: api.forward(lm, [-1, 2]), "-1 is outside the vocabulary"),
        (lambda: api.forward(lm, []), "non-empty prompt"),
        (lambda: api.forward(lm, [1.5, 2]), "must be integers"),
        (lambda: api.generate(lm, [1, 2], 0), "max_new_tokens"),
        (lambda: api.generate(lm, [1, 2], -3), "max_new_tokens"),
        (lambda: api.generate_batch(lm, [[1, 2], [10**6]], 3), "prompt 1: prompt token id 1000000"),
        (lambda: api.generate_batch(lm, [[1, 2]], 3, temperature=-1.0), "temperature"),
        (lambda: api.generate_batch(lm, [[1, 2]], 3, temperature=float("nan")), "temperature"),
        (lambda: api.generate_batch(lm, [[1, 2]], 3, top_p=0.0), "top_p"),
        (lambda: api.generate_batch(lm, [], 3), "at least one prompt"),
        (lambda: api.generate_batch(lm, [[1, 2]], 3, eos_token_ids=["x"]), "eos_token_ids"),
    ):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1], 7])
def test_generate_refuses_a_batch_naming_generate_batch(lm, prompts):
    """`api.generate` is for one prompt: a batch (ragged or not) or a bare int is a ValueError that
    points at `generate_batch`, not a TypeError from deep inside."""
    with pytest.raises(ValueError, match="generate_batch"):
        api.generate(lm, prompts, 2)
