"""Capacity planner and roofline model for GLM-5.x serving (docs/design.md §3.4, §4.2, §6.1, §9).

How many requests of a given length fit at once, in bytes for a deployment description and in
the engine's own units (arena pages of each KV cache group), plus the sparse-MLA roofline. One
concern per module:

* `kv_bytes`: per-token KV bytes (MLA latent rows, indexer keys, the MTP layer) and the byte
  constants;
* `hardware`: the accelerators (HBM, dense BF16 FLOP/s, bandwidth);
* `weights`: checkpoint weight bytes, split by how a layout shards them;
* `planner`: deployments and their concurrency, device-resident and under Hybrid HiSparse;
* `roofline`: the sparse-MLA roofline and the indexer crossover;
* `engine_units`: the same rules in arena pages, as the engine logs and admits.

Everything is re-exported here: `from glm53.capacity import capacity, kv_bytes_per_token`.
"""

from __future__ import annotations

from glm53.capacity.engine_units import (
    HiSparsePagePlan,
    engine_capacity_summary,
    pages_per_request,
    predict_device_resident_requests,
    predict_hisparse_requests,
)
from glm53.capacity.hardware import H200, Accelerator
from glm53.capacity.kv_bytes import (
    ACTIVATION_BYTES,
    CHECKPOINT_DTYPES,
    FP8_TILE,
    FP8_WEIGHT_BLOCK,
    INDEX_BYTES,
    KV_DTYPES,
    TAIL_PAGES,
    GiB,
    KVBytesPerToken,
    MiB,
    indexer_row_bytes,
    kv_bytes_per_token,
    mla_row_bytes,
    normalize_kv_dtype,
    request_kv_bytes,
)
from glm53.capacity.planner import (
    CapacityPoint,
    Deployment,
    capacity,
    deployment_parallel_config,
    deployment_weight_format,
    hisparse_device_bound,
    hisparse_layouts,
    host_pool_rounded,
    kv_room_per_gpu,
    reference_deployments,
    weight_bytes_breakdown_per_gpu,
    weight_bytes_per_gpu,
)
from glm53.capacity.roofline import Roofline, indexer_crossover_tokens, sparse_mla_roofline
from glm53.capacity.weights import WeightBytes, checkpoint_weight_bytes

__all__ = [
    "ACTIVATION_BYTES", "CHECKPOINT_DTYPES", "FP8_TILE", "FP8_WEIGHT_BLOCK", "H200", "INDEX_BYTES", "KV_DTYPES",
    "TAIL_PAGES", "Accelerator", "CapacityPoint", "Deployment", "GiB", "HiSparsePagePlan", "KVBytesPerToken", "MiB",
    "Roofline", "WeightBytes", "capacity", "checkpoint_weight_bytes", "deployment_parallel_config",
    "deployment_weight_format", "engine_capacity_summary", "hisparse_device_bound", "hisparse_layouts",
    "host_pool_rounded", "indexer_crossover_tokens", "indexer_row_bytes", "kv_bytes_per_token", "kv_room_per_gpu",
    "mla_row_bytes", "normalize_kv_dtype", "pages_per_request", "predict_device_resident_requests",
    "predict_hisparse_requests", "reference_deployments", "request_kv_bytes", "sparse_mla_roofline",
    "weight_bytes_breakdown_per_gpu", "weight_bytes_per_gpu",
]
