"""docs/design.md §10's equality rule (glm53/equality.py): identical streams pass, a divergence is accepted
only at a small top-2 logit gap or a small indexer top-k boundary gap, and the indexer diagnostic
reports no boundary while every key is selected."""

from __future__ import annotations

import math

import numpy as np
import pytest

from glm53 import api
from glm53.equality import compare_streams, indexer_boundary_gap, top2_gap

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model


class _Lp:
    def __init__(self, *logprobs):
        self.top = [(i, v) for i, v in enumerate(logprobs)]


def test_divergences_are_accepted_only_by_a_stated_rule():
    ref = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8]}
    gaps = {"a": [_Lp(-0.1, -3.0)] * 3, "b": [_Lp(-1.0, -1.00001), _Lp(-1.0, -1.00002), _Lp(-0.5, -4)],
            "c": [0.5, 0.5]}
    assert compare_streams(ref, {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8]}, gaps, {}) == []
    divs = compare_streams(ref, {"a": [1, 2, 3], "b": [4, 9, 9], "c": [7, 8]}, gaps, {})
    assert [(d.key, d.index, d.accepted_by) for d in divs] == [("b", 1, "logit")]
    with pytest.raises(AssertionError, match="UNEXPLAINED"):
        compare_streams(ref, {"a": [1, 9, 3], "b": [4, 5, 6], "c": [7, 8]}, gaps, {})
    loose = compare_streams(ref, {"a": [1, 9, 3], "b": [4, 5, 6]}, gaps, {}, strict=False, verbose=False)
    assert [(d.key, d.accepted_by) for d in loose] == [("a", None), ("c", None)]
    assert top2_gap(_Lp(-0.2, -0.7, -5.0)) == pytest.approx(0.5) and top2_gap(0.25) == 0.25


def test_indexer_boundary_gap_is_none_while_every_key_is_selected_and_finite_beyond():
    lm = api.load()
    K = lm.config.index_topk
    rng = np.random.default_rng(0)
    assert indexer_boundary_gap(lm, rng.integers(10, 400, K).tolist()) == math.inf  # K keys: all selected
    gap = indexer_boundary_gap(lm, rng.integers(10, 400, 3 * K).tolist())
    assert 0 <= gap < math.inf
