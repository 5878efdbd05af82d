"""Deployments and their concurrency: how many requests of L tokens fit at once, device-resident
and under Hybrid HiSparse (docs/design.md §3.4, §6.1, §9; the source documents give the inputs of
the reference calculator, the formulas are reconstructed). With KV room `R` bytes per device:

* device-resident: ⌊R / (L · B)⌋, B = all per-token bytes (54,728);
* Hybrid HiSparse, device-bound: 1 + ⌊(R − (L · B + hot)) / (L · B_idx + hot + tail)⌋: one
  request fully resident while it is admitted, every other one at its steady-state footprint:
  its indexer keys (B_idx = 22 · 132 = 2,904 B per token), a hot lease of m · index_topk rows of
  all sparse-MLA layers (m · 2048 · 79 · 656 B) and its two newest (tail) MLA pages;
* Hybrid HiSparse, host-bound: ⌊host pool / (L · B_host)⌋, B_host = 79 · 656 = 51,824 B per
  token (all sparse-MLA layers, MTP included, live on the host);
* HiSparse = min(device-bound, host-bound); the minimum host pool is device-bound · L · B_host.

Parallel layout: a replica (one attention group) spans `tp × pcp` devices; `dp` replicas run side
by side. The MLA latent is replicated over TP (one latent head), so every device of a replica holds
the KV of all that replica's requests unless DCP shards it: with DCP N a device holds ⌈L / N⌉ of
each request's tokens. Concurrency figures are per replica times `dp`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from glm53.capacity.hardware import H200, Accelerator
from glm53.capacity.kv_bytes import (
    CHECKPOINT_DTYPES,
    FP8_WEIGHT_BLOCK,
    TAIL_PAGES,
    GiB,
    kv_bytes_per_token,
    normalize_kv_dtype,
)

from glm53.config import GlmConfig


@dataclass(frozen=True)
class Deployment:
    """A serving deployment, as the reference calculator describes one.

    accelerator / num_gpus: the devices (HBM per device from the accelerator).
    gpu_memory_utilization: fraction of HBM the engine may use (weights + runtime + KV).
    checkpoint_dtype: "fp8" (FP8 weights kept on the device) or "bf16"; weight bytes per device
        follow from it and the layout through the model's parameter tree (`weight_bytes_per_gpu`)
        unless `weight_bytes_per_gpu` is given.
    runtime_reserve_bytes: per device, for activations, graphs and communication buffers. The
        default 9 GiB is an assumption: with it the PCP8 × DCP8 prefill engine of the source keeps
        ≈ 15 GiB of KV room per device, the source's "about 15 GiB".
    tp / dp / pcp / dcp: tensor, data, prefill-context and decode-context parallel sizes;
        num_gpus = tp · dp · pcp; DCP shards the KV over devices of one attention group
        (tp · pcp must be a multiple of dcp).
    enable_expert_parallel: routed experts split over all tp · dp · pcp devices (else over tp).
    kv_cache_dtype: "fp8" (fp8_ds_mla), "bf16" or "fp32".
    index_topk: top-k rows per query (None: the config's, 2048).
    num_speculative_tokens: MTP draft tokens (> 0 also counts the MTP layer's KV).
    hot_buffer_multiplier: hot lease = multiplier · index_topk rows per request; None: the
        engine default num_speculative_tokens + 2 (docs/design.md §6.1). The reference calculator uses 2
        whatever the speculation (source).
    host_pool_bytes: HiSparse host pool per DP replica (rounded up to whole host blocks).
    indexer_offload_bytes: the separate host pool (OffloadingConnector) per DP replica that parks
        indexer KV of idle prefixes.
    block_size: tokens per page (64).
    max_model_len: the context length the deployment serves.
    prefill_window_tokens: tokens of the request being admitted that must be fully resident on
        the device. None: the engine's rule (`serving/hisparse/residency.py`): all of it when
        that fits the KV room, else an in-flight window of `2 · max_num_batched_tokens` tokens
        (the chunk being prefilled and the previous one, whose host copy is in flight) plus a
        prefill hot buffer of `prefill_hot_rows` rows.
    max_num_batched_tokens: the prefill chunk (the reference deployment's 32,768).
    prefill_hot_rows: hot-buffer rows of a request prefilling with pages off the device (the
        engine's `prefill_buffer_size`; None: 16 · index_topk). Its chunk is then capped at
        prefill_hot_rows / index_topk query rows (each may miss its whole top-k).
    """

    name: str = "custom"
    accelerator: Accelerator = H200
    num_gpus: int = 8
    gpu_memory_utilization: float = 0.92
    checkpoint_dtype: str = "fp8"
    weight_bytes_per_gpu: int | None = None
    runtime_reserve_bytes: int = 9 * GiB
    tp: int = 8
    dp: int = 1
    pcp: int = 1
    dcp: int = 1
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "fp8"
    index_topk: int | None = None
    num_speculative_tokens: int = 0
    hot_buffer_multiplier: int | None = None
    host_pool_bytes: int = 0
    indexer_offload_bytes: int = 0
    block_size: int = 64
    max_model_len: int = 1_048_576
    prefill_window_tokens: int | None = None
    max_num_batched_tokens: int = 32_768
    prefill_hot_rows: int | None = None

    def __post_init__(self) -> None:
        for f in ("num_gpus", "tp", "dp", "pcp", "dcp", "block_size", "max_model_len"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.tp * self.dp * self.pcp != self.num_gpus:
            raise ValueError(f"tp·dp·pcp = {self.tp * self.dp * self.pcp} != num_gpus {self.num_gpus}")
        if (self.tp * self.pcp) % self.dcp:
            raise ValueError(f"dcp {self.dcp} must divide the attention group tp·pcp = {self.tp * self.pcp}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        normalize_kv_dtype(self.kv_cache_dtype)
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"checkpoint_dtype {self.checkpoint_dtype!r} not one of {CHECKPOINT_DTYPES}")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.hot_buffer_multiplier is not None and self.hot_buffer_multiplier < 1:
            raise ValueError("hot_buffer_multiplier must be >= 1")
        if self.host_pool_bytes < 0 or self.indexer_offload_bytes < 0 or self.runtime_reserve_bytes < 0:
            raise ValueError("pool and reserve sizes must be >= 0")
        if self.prefill_window_tokens is not None and self.prefill_window_tokens < 1:
            raise ValueError("prefill_window_tokens must be >= 1")
        if self.max_num_batched_tokens < 1 or (self.prefill_hot_rows is not None and self.prefill_hot_rows < 1):
            raise ValueError("max_num_batched_tokens and prefill_hot_rows must be >= 1")

    def replace(self, **changes) -> "Deployment":
        """A copy with fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def ep(self) -> int:
        """Devices the routed experts are split over."""
        return self.tp * self.dp * self.pcp if self.enable_expert_parallel else self.tp

    @property
    def with_mtp(self) -> bool:
        """Whether the MTP layer's KV is allocated (MTP speculation on)."""
        return self.num_speculative_tokens > 0

    @property
    def hot_multiplier(self) -> int:
        """Hot-buffer rows per request in units of index_topk."""
        if self.hot_buffer_multiplier is not None:
            return self.hot_buffer_multiplier
        return self.num_speculative_tokens + 2

    def describe(self) -> str:
        """One line naming the layout, e.g. `8×H200 TP8 fp8-KV MTP3 util 0.92`."""
        par = [f"{k.upper()}{v}" for k, v in (("tp", self.tp), ("dp", self.dp), ("pcp", self.pcp), ("dcp", self.dcp))
               if v > 1] or ["1 device"]
        if self.enable_expert_parallel:
            par.append(f"EP{self.ep}")
        extra = f" MTP{self.num_speculative_tokens}" if self.num_speculative_tokens else ""
        host = ""
        if self.host_pool_bytes:
            host += f", HiSparse host pool {self.host_pool_bytes / GiB:g} GiB/replica (hot {self.hot_multiplier}×top-k)"
        if self.indexer_offload_bytes:
            host += f", indexer offload {self.indexer_offload_bytes / GiB:g} GiB/replica"
        return (f"{self.num_gpus}×{self.accelerator.name} {' '.join(par)}, {normalize_kv_dtype(self.kv_cache_dtype)} KV"
                f"{extra}, util {self.gpu_memory_utilization:g}{host}")


def deployment_parallel_config(dep: Deployment):
    """The `sharding.mesh.ParallelConfig` whose parameter sharding `dep` describes: tp, dp, pcp and
    enable_expert_parallel as given; DCP left at 1 (it shards only the KV cache, never a weight)."""
    from sharding.mesh import ParallelConfig

    return ParallelConfig(tensor_parallel_size=dep.tp, data_parallel_size=dep.dp,
                          prefill_context_parallel_size=dep.pcp, enable_expert_parallel=dep.enable_expert_parallel)


def deployment_weight_format(dep: Deployment):
    """(model dtype, `WeightQuant` or None) of `dep.checkpoint_dtype`: "fp8" → bf16 with FP8 weights
    kept on the device in 128×128 blocks (`WeightQuant((128, 128))`), "bf16" → bf16, unquantised."""
    import jax.numpy as jnp

    from glm53.quant import WeightQuant

    quant = WeightQuant(block=(FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK)) if dep.checkpoint_dtype == "fp8" else None
    return jnp.bfloat16, quant


def weight_bytes_breakdown_per_gpu(cfg: GlmConfig, dep: Deployment, by: str = "kind") -> dict[str, int]:
    """`weight_bytes_per_gpu` of the parameter tree split by kind ("fp8" codes, "fp8_scales",
    "unquantised") or by part of the model (by="part"); bytes per device
    (`glm53.weight_bytes.weight_bytes_breakdown`). Ignores `dep.weight_bytes_per_gpu`."""
    from glm53.weight_bytes import weight_bytes_breakdown

    dtype, quant = deployment_weight_format(dep)
    return weight_bytes_breakdown(cfg, dtype=dtype, quant=quant, parallel=deployment_parallel_config(dep),
                                  with_mtp=dep.with_mtp, by=by)


def weight_bytes_per_gpu(cfg: GlmConfig, dep: Deployment) -> int:
    """Weight bytes on each device: `dep.weight_bytes_per_gpu` if given, else the model's real
    parameter tree (`glm53.weight_bytes.device_weight_bytes`: `GlmForCausalLM` built abstractly in
    `deployment_weight_format(dep)`, each parameter's shard under `deployment_parallel_config(dep)`
    by the partition rules of sharding/rules.py). The MTP layer's weights count only when MTP
    speculation is on (`dep.with_mtp`). GLM-5.3 FP8 checkpoint, MTP on: TP8 ≈ 91.3 GiB (attention
    heads, MLP columns, lm_head and expert columns split 8 ways; embeddings, q_a/kv_a, the indexer,
    norms and routers replicated), DP8 + EP8 ≈ 105.3 GiB (experts split 8 ways, everything else
    replicated)."""
    if dep.weight_bytes_per_gpu is not None:
        return dep.weight_bytes_per_gpu
    from glm53.weight_bytes import device_weight_bytes

    dtype, quant = deployment_weight_format(dep)
    return device_weight_bytes(cfg, dtype=dtype, quant=quant, parallel=deployment_parallel_config(dep),
                               with_mtp=dep.with_mtp)


def kv_room_per_gpu(cfg: GlmConfig, dep: Deployment) -> int:
    """KV bytes per device: HBM · gpu_memory_utilization − weights − runtime reserve (≥ 0)."""
    hbm = int(dep.accelerator.hbm_bytes * dep.gpu_memory_utilization)
    return max(0, hbm - weight_bytes_per_gpu(cfg, dep) - dep.runtime_reserve_bytes)


def host_pool_rounded(cfg: GlmConfig, dep: Deployment) -> int:
    """The HiSparse host pool rounded up to whole host blocks (block_size tokens of every
    sparse-MLA layer; source: `host_pool_gib` is rounded up to host blocks)."""
    block = dep.block_size * kv_bytes_per_token(cfg, dep.kv_cache_dtype, dep.with_mtp).sparse_mla
    return math.ceil(dep.host_pool_bytes / block) * block


@dataclass(frozen=True)
class CapacityPoint:
    """Capacity of a deployment for equal requests of `seq_len` tokens (fields named *_bytes are
    bytes, the others request counts or tokens).

    Bytes are per device unless named otherwise; request counts are for the whole deployment
    (per replica · dp), except `*_per_replica`.

    kv_room_per_gpu: the KV budget R. request_bytes: one request's KV, all devices of a shard
    set together (L · B). request_bytes_per_gpu: what one device holds of it (⌈L/dcp⌉ · B).
    device_resident: ⌊R / request_bytes_per_gpu⌋ · dp.
    hot_bytes / tail_bytes / steady_bytes: a HiSparse request's hot lease, tail pages and
    steady-state footprint (indexer + hot + tail) per device. first_bytes: the admitted request's
    fully resident footprint (+ its hot lease).
    hisparse_device_bound / hisparse_host_bound / hisparse: docs/design.md §9 (host-bound and min are 0
    when there is no host pool). hybrid: max(device_resident, hisparse) — Hybrid HiSparse only
    offloads under pressure, so it never admits fewer than device-resident serving.
    min_host_pool_bytes: per replica, the smallest pool with host-bound ≥ device-bound.
    indexer_offload_prefixes: idle prefixes of seq_len tokens whose indexer KV the separate
    offload pool can park (per replica · dp); indexer_offload_tokens likewise in tokens.
    """

    seq_len: int
    kv_room_per_gpu: int
    request_bytes: int
    request_bytes_per_gpu: int
    device_resident: int
    hot_bytes: int
    tail_bytes: int
    first_bytes: int
    steady_bytes: int
    hisparse_device_bound: int
    hisparse_host_bound: int
    hisparse: int
    hybrid: int
    min_host_pool_bytes: int
    indexer_offload_prefixes: int
    indexer_offload_tokens: int


def hisparse_device_bound(room: int, first_bytes: int, steady_bytes: int) -> int:
    """Requests HiSparse holds on a device of `room` KV bytes (docs/design.md §9): the admitted request
    fully resident (`first_bytes`) plus ⌊(room − first) / steady⌋ others at their steady-state
    footprint (`steady_bytes`); 0 when the admitted request alone does not fit."""
    if room < first_bytes:
        return 0
    return 1 + (room - first_bytes) // steady_bytes


def capacity(cfg: GlmConfig, dep: Deployment, seq_len: int) -> CapacityPoint:
    """Device-resident and Hybrid HiSparse concurrency of `dep` at `seq_len` tokens per request.

    Formulas: module docstring (docs/design.md §9). Per device, with Lr = ⌈L/dcp⌉:
    device-resident ⌊R / (Lr·B)⌋; first = Wr·B + (Lr − Wr)·B_idx + hot (W = the prefill window:
    `prefill_window_tokens` when given; by the engine's rule all of L when Lr·B + hot fits R, else
    2 · max_num_batched_tokens, with hot then the prefill buffer of `prefill_hot_rows` rows);
    steady = Lr·B_idx + hot + tail; hot = ⌈m·K / block⌉·block rows · B_host (not divided by DCP:
    one rank may own every selected row); tail = 2 pages · block · B_host; host-bound
    ⌊pool / (L·B_host)⌋ per replica.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    kv = kv_bytes_per_token(cfg, dep.kv_cache_dtype, dep.with_mtp)
    room = kv_room_per_gpu(cfg, dep)
    lr = math.ceil(seq_len / dep.dcp)
    req_gpu = lr * kv.total
    resident = room // req_gpu * dep.dp

    topk = dep.index_topk if dep.index_topk is not None else cfg.index_topk
    hot_rows = math.ceil(dep.hot_multiplier * topk / dep.block_size) * dep.block_size
    hot = hot_rows * kv.sparse_mla
    tail = TAIL_PAGES * dep.block_size * kv.sparse_mla
    first_hot = hot
    if dep.prefill_window_tokens is not None:
        window = min(seq_len, dep.prefill_window_tokens)
    elif lr * kv.total + hot <= room:
        window = seq_len
    else:  # the engine's in-flight window: two chunks, and the prefill hot buffer
        window = min(seq_len, 2 * dep.max_num_batched_tokens)
        rows = dep.prefill_hot_rows if dep.prefill_hot_rows is not None else 16 * topk
        first_hot = max(hot, math.ceil(rows / dep.block_size) * dep.block_size * kv.sparse_mla)
    wr = math.ceil(window / dep.dcp)
    first = wr * kv.total + (lr - wr) * kv.device_indexer + first_hot
    steady = lr * kv.device_indexer + hot + tail
    dev_bound = hisparse_device_bound(room, first, steady)
    pool = host_pool_rounded(cfg, dep)
    host_req = seq_len * kv.sparse_mla
    host_bound = pool // host_req
    hs = min(dev_bound, host_bound)
    host_block = dep.block_size * kv.sparse_mla
    min_pool = math.ceil(dev_bound * host_req / host_block) * host_block
    idx_req = seq_len * kv.device_indexer
    return CapacityPoint(
        seq_len=seq_len,
        kv_room_per_gpu=room,
        request_bytes=seq_len * kv.total,
        request_bytes_per_gpu=req_gpu,
        device_resident=resident,
        hot_bytes=hot,
        tail_bytes=tail,
        first_bytes=first,
        steady_bytes=steady,
        hisparse_device_bound=dev_bound * dep.dp,
        hisparse_host_bound=host_bound * dep.dp,
        hisparse=hs * dep.dp,
        hybrid=max(resident, hs * dep.dp),
        min_host_pool_bytes=min_pool,
        indexer_offload_prefixes=dep.indexer_offload_bytes // idx_req * dep.dp,
        indexer_offload_tokens=dep.indexer_offload_bytes // kv.device_indexer * dep.dp,
    )


def reference_deployments() -> dict[str, Deployment]:
    """The source documents' 8×H200 deployments (FP8 KV, MTP3, FP8 checkpoint):

    * `tp8-hisparse`: one node, TP8 (experts TP-sharded), util 0.92, --max-model-len 142000,
      HiSparse pool 384 GiB + 128 GiB indexer/prefix offload (part 1). Hot lease 2 × top-k as in
      the reference calculator (which ignores the MTP sizing, source).
    * `dp8-decode`: the decode node of part 2: DP8 attention, EP8, HiSparse 48 GiB + 16 GiB offload
      per rank, 1M context.
    * `pcp8-dcp8-prefill`: the prefill node of part 2: PCP8 × DCP8 × EP8, no TP (attention weights
      replicated), 1M context, KV sharded by DCP8.
    * `tp8-dcp8-hisparse`: part 1's node with the KV also sharded by token over its 8 TP ranks
      (DCP8) under HiSparse, 1M context — the combination no other engine serves.
    """
    common = dict(accelerator=H200, num_gpus=8, gpu_memory_utilization=0.92, checkpoint_dtype="fp8",
                  kv_cache_dtype="fp8", num_speculative_tokens=3)
    return {
        "tp8-hisparse": Deployment(name="tp8-hisparse", tp=8, hot_buffer_multiplier=2, host_pool_bytes=384 * GiB,
                                   indexer_offload_bytes=128 * GiB, max_model_len=142_000, **common),
        "dp8-decode": Deployment(name="dp8-decode", tp=1, dp=8, enable_expert_parallel=True,
                                 hot_buffer_multiplier=2, host_pool_bytes=48 * GiB, indexer_offload_bytes=16 * GiB,
                                 max_model_len=1_048_576, **common),
        "pcp8-dcp8-prefill": Deployment(name="pcp8-dcp8-prefill", tp=1, pcp=8, dcp=8, enable_expert_parallel=True,
                                        max_model_len=1_048_576, **common),
        "tp8-dcp8-hisparse": Deployment(name="tp8-dcp8-hisparse", tp=8, dcp=8, hot_buffer_multiplier=2,
                                        host_pool_bytes=384 * GiB, indexer_offload_bytes=128 * GiB,
                                        max_model_len=1_048_576, **common),
    }


def hisparse_layouts(seq_len: int = 1_048_576) -> dict[str, Deployment]:
    """One 8×H200 node serving `seq_len`-token contexts with Hybrid HiSparse, three ways, at the
    reference memory sizes (FP8 weights and KV, MTP3, util 0.92, hot lease 2 × top-k, 512 GiB of
    host memory for HiSparse + indexer offload per node):

    * `TP8 + HiSparse` — one replica, the 384 GiB pool shared by its TP ranks (one host copy);
    * `TP8 × DCP8 + HiSparse` — the same node with the KV sharded by token over the 8 TP ranks:
      each rank holds 1/8 of every context (indexer keys included) and its token share of the
      host pool, but a full hot buffer per request (any rank may own a whole top-k);
    * `DP8 + HiSparse` — 8 attention replicas (EP8 experts) with 48 GiB pools each.
    """
    refs = reference_deployments()
    return {
        "TP8 + HiSparse": refs["tp8-hisparse"].replace(max_model_len=seq_len),
        "TP8 x DCP8 + HiSparse": refs["tp8-dcp8-hisparse"].replace(max_model_len=seq_len),
        "DP8 + HiSparse": refs["dp8-decode"].replace(max_model_len=seq_len),
    }
