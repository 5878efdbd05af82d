"""HiSparse's per-step counters at GLM-5.3 sizes: the device reports them per KV shard (int32,
`HotState.stats_Z5`) and the host sums them in 64-bit (`sum_shard_stats`), so a wide layout's
step cannot wrap where an int32 sum over the shards would."""

from __future__ import annotations

import numpy as np

from serving.hisparse.device_state import sum_shard_stats


def test_a_wide_layouts_step_is_counted_exactly():
    # One KV shard of a GLM-5.3 prefill step: 16 prefilling requests, each missing its whole
    # 32,768-row lease, in every one of the 78 sparse-MLA layers → 40.9 M layer rows per shard
    # (inside int32); 64 shards (DP8 × DCP8) → 2.6 G, past 2**31.
    per_shard = 16 * 32_768 * 78
    stats = np.tile(np.array([[7, 16 * 32_768 * 20, 0, per_shard, 3]], np.int32), (64, 1))
    hits, misses, dropped, rows, reads = sum_shard_stats(stats)
    assert rows == 64 * per_shard > 2**31 and misses == 64 * 16 * 32_768 * 20 and hits == 7 * 64
    assert (dropped, reads) == (0, 3 * 64)
    assert int(stats.sum(axis=0, dtype=np.int32)[3]) != rows  # an int32 sum over the shards wraps
    assert sum_shard_stats(np.array([1, 2, 3, 4, 5], np.int32)) == (1, 2, 3, 4, 5)  # an already summed [5]
