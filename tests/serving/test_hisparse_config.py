"""`hisparse_config` parsing and the start-up checks (serving/hisparse/config.py): defaults follow
the speculation and index_topk, sizes round up to whole pages, and every refusal names the key."""

from __future__ import annotations

import pytest

from serving.hisparse.config import GiB, HiSparseConfig, HiSparseConfigError, check_host_pool


def test_defaults_and_rounding():
    r = HiSparseConfig.from_dict({"host_pool_gib": 1}).resolve(index_topk=2048, tokens_per_page=64)
    assert (r.device_buffer_rows, r.max_hot_rows, r.mechanism) == (2 * 2048, 16 * 2048, "memory_kind")
    assert r.config.prefill_sizing == "adaptive"
    assert HiSparseConfig.from_dict({"host_pool_gib": 1, "prefill_sizing": "worst_case"}).prefill_sizing == "worst_case"
    r = HiSparseConfig.from_dict({"host_pool_gib": 1}).resolve(index_topk=2048, tokens_per_page=64,
                                                               num_speculative_tokens=3)
    assert r.device_buffer_rows == 5 * 2048  # (num_speculative_tokens + 2) x top-k
    r = HiSparseConfig.from_dict({"host_pool_gib": 1, "device_buffer_size": 100, "prefill_buffer_size": 130,
                                  "host_gather": "callback"}).resolve(index_topk=64, tokens_per_page=64)
    assert (r.device_buffer_rows, r.max_hot_rows, r.mechanism) == (128, 192, "callback")
    assert r.prefill_hot_rows == r.max_hot_rows  # no lease growth by default
    g = HiSparseConfig.from_dict({"host_pool_gib": 1, "prefill_buffer_size": 130, "prefill_buffer_max_size": 300}
                                 ).resolve(index_topk=64, tokens_per_page=64)
    assert (g.prefill_hot_rows, g.max_hot_rows) == (192, 320)  # the sure lease; the growth cap = hot state width
    with pytest.raises(HiSparseConfigError, match="prefill_buffer_max_size 192 is below prefill_buffer_size 256"):
        HiSparseConfig.from_dict({"host_pool_gib": 1, "prefill_buffer_size": 200, "prefill_buffer_max_size": 150}
                                 ).resolve(index_topk=64, tokens_per_page=64)
    assert HiSparseConfig.from_dict({"host_pool_gib": 1}).resolve(
        index_topk=64, tokens_per_page=64, backend="gpu").mechanism == "callback"
    # host_pool_gib rounds up to whole host blocks, plus the null block
    assert r.host_blocks(3 * 2**20) == -(-GiB // (3 * 2**20)) + 1


@pytest.mark.parametrize("d, key", [
    ({}, "host_pool_gib"),
    ({"host_pool_gib": 0}, "host_pool_gib"),
    ({"host_pool_gib": "8"}, "host_pool_gib"),
    ({"host_pool_gib": 1, "device_buffer_size": 0}, "device_buffer_size"),
    ({"host_pool_gib": 1, "host_gather": "dma"}, "host_gather"),
    ({"host_pool_gib": 1, "watermark": 1.5}, "watermark"),
    ({"host_pool_gib": 1, "prefill_sizing": "optimistic"}, "prefill_sizing"),
    ({"host_pool_gib": 1, "prefill_buffer_max_size": -1}, "prefill_buffer_max_size"),
    ({"host_pool_gib": 1, "hot": 2}, "unknown key"),
])
def test_bad_values_name_the_key(d, key):
    with pytest.raises(HiSparseConfigError, match=key):
        HiSparseConfig.from_dict(d)


def test_a_device_buffer_below_spec_plus_one_topk_is_refused():
    cfg = HiSparseConfig.from_dict({"host_pool_gib": 1, "device_buffer_size": 3 * 64})
    cfg.resolve(index_topk=64, tokens_per_page=64, num_speculative_tokens=2)  # exactly (2 + 1) x 64
    with pytest.raises(HiSparseConfigError, match="device_buffer_size 192 is below"):
        cfg.resolve(index_topk=64, tokens_per_page=64, num_speculative_tokens=3)
    with pytest.raises(HiSparseConfigError, match="prefill_buffer_size"):
        HiSparseConfig.from_dict({"host_pool_gib": 1, "prefill_buffer_size": 64}).resolve(index_topk=64,
                                                                                          tokens_per_page=64)


def test_host_pool_must_hold_one_request_and_fit_the_host():
    block = 64 * 51_824
    check_host_pool(1 + 2048 // 64, block, 2048, 64, available=1 << 40)
    with pytest.raises(HiSparseConfigError, match="host_pool_gib holds 31 host blocks.*one --max-model-len 2048"):
        check_host_pool(32, block, 2048, 64, available=1 << 40)
    with pytest.raises(HiSparseConfigError, match="host_pool_gib.*exceeds the .* of host memory available"):
        check_host_pool(1001, block, 2048, 64, available=1000 * block - 1)
