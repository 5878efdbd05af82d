"""Slot ids of the batch builders at production sizes: computed in 64 bits, refused past int32
(the arena index dtype of every device program), never wrapped."""

import numpy as np
import pytest

from glm53.batch import page_slots, single_sequence_batch
from glm53.config import preset
from glm53.kv_layout import build_kv_layout
from glm53.parallel_batch import replica_batch


def test_page_slots_in_range_and_at_the_int32_limit():
    # 1M-token context, DCP 8: engine pages of the mtp group hold 4,096 × 8 tokens.
    tpp = 4096 * 8
    assert page_slots([0, 65_535], [tpp + 5], tpp).tolist() == [65_535 * tpp + 5]  # 2,147,450,885 < 2**31
    with pytest.raises(ValueError, match="does not fit int32"):
        page_slots([0, 65_536], [tpp], tpp)  # 65,536 × 32,768 = 2**31


def test_batch_builders_refuse_a_slot_past_int32_instead_of_wrapping():
    lay = build_kv_layout(preset("glm-5.3"), "fp8")
    widest = max(g.tokens_per_page for g in lay.groups) * 8  # the widest engine page under DCP 8 (the indexer's)
    big = {g.name: [2**31 // widest + 1] for g in lay.groups}
    with pytest.raises(ValueError, match="does not fit int32"):
        replica_batch(lay, [([1, 2], 0, big)], 4, 2, dcp=8)
    with pytest.raises(ValueError, match="does not fit int32"):
        single_sequence_batch(build_kv_layout(preset("glm-5.3"), "fp8"), [1], 0,
                              {g.name: [2**31 // g.tokens_per_page + 1] for g in lay.groups})
    ok = replica_batch(lay, [([1, 2], 0, {g.name: [9_507] for g in lay.groups})], 4, 2, dcp=8)
    tpp = {g.name: g.tokens_per_page * 8 for g in lay.groups}
    for g in lay.groups:  # the largest block of a 29 GiB arena: exact slots
        assert np.asarray(ok.slot_mapping[g.name])[:2].tolist() == [9_507 * tpp[g.name], 9_507 * tpp[g.name] + 1]
