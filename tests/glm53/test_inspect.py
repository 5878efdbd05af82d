"""`glm53.inspect.indexer_selections`: one selection per full layer, causal, distinct,
`min(i + 1, index_topk)` positions per query row (all of them below index_topk), differing
between layers past index_topk, deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from glm53 import api
from glm53.inspect import indexer_selections

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model


def test_selections_are_causal_and_full():
    lm = api.load()
    ids = [(11 * i) % 400 + 5 for i in range(100)]
    sel = indexer_selections(lm, ids)
    K = lm.config.index_topk
    assert len(sel) == len(lm.config.full_layers)
    for s in sel:
        assert s.shape == (100, K)
        for q in range(100):
            got = s[q][s[q] >= 0]
            assert len(got) == min(q + 1, K) and (got <= q).all() and len(set(got)) == len(got)
        assert sorted(s[10][s[10] >= 0]) == list(range(11))  # fewer than K positions: all of them
    # Different layers select differently past K (they are different indexers).
    assert any(set(a[-1]) != set(b[-1]) for a, b in zip(sel, sel[1:]))
    assert np.array_equal(indexer_selections(lm, ids)[0], sel[0])  # deterministic
