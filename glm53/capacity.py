"""Capacity planner and roofline model for GLM-5.x serving (docs/design.md §3.4, §4.2, §6.1, §9).

How many requests of a given length fit at once, in bytes for a deployment description and in
the engine's own units (arena pages of each KV cache group), plus the sparse-MLA roofline.

Per-token KV bytes (source; docs/design.md §4.2):

* MLA latent row per layer: `fp8_ds_mla` = A + 4·A/128 + 2·R (656 B for A = 512, R = 64: 512 e4m3
  values, 4 fp32 tile scales, 64 bf16 rope values); bf16 = 2·(A+R) (1152 B); fp32 = 4·(A+R).
* Indexer key per full layer: fp8 = Dk + 4 (132 B: 128 e4m3 values and one fp32 scale);
  bf16 = 2·Dk (256 B); fp32 = 4·Dk.
* The MTP layer has its own MLA row and its own indexer key: 656 + 132 = 788 B.

GLM-5.3 with FP8 KV: 78·656 + 21·132 + 788 = 54,728 B per token; a 1,048,576-token request holds
54,728 MiB ≈ 53.4 GiB, and ≈ 6.7 GiB per device when DCP8 shards it over 8 devices (source).

Concurrency (docs/design.md §9; the source documents give the inputs of the reference calculator, the
formulas are reconstructed). With KV room `R` bytes per device and a request of `L` tokens:

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

Roofline of sparse MLA (source): a selected row is 656 + 4 (int32 index) = 660 B; each head adds a
bf16 query (A+R wide) and output (A wide), 2,176 B, and costs 2·(A+R) + 2·A = 2,176 FLOPs per row.
Per query token with h heads: bytes = K·660 + h·2,176, FLOPs = h·K·2,176 → ≈26 FLOPs/B at 8
heads (TP8), ≈191 at 64 (PCP). H200 ridge: 989 TFLOP/s dense BF16 ÷ 4.8 TB/s ≈ 206 FLOPs/B.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Mapping

from glm53.config import GlmConfig

MiB, GiB = 2**20, 2**30

KV_DTYPES = ("fp8", "bf16", "fp32")
# Other spellings of the KV dtype (vLLM's --kv-cache-dtype values, the arena's row dtypes).
_KV_DTYPE_ALIASES = {
    "fp8": "fp8", "fp8_ds_mla": "fp8", "fp8_e4m3": "fp8",
    "bf16": "bf16", "bfloat16": "bf16", "auto": "bf16",
    "fp32": "fp32", "float32": "fp32",
}
CHECKPOINT_DTYPES = ("fp8", "bf16")

# fp8_ds_mla quantises the latent in tiles of this many values, one fp32 scale per tile.
FP8_TILE = 128
# FP8 checkpoints quantise linear weights in [128, 128] blocks with one fp32 scale per block.
FP8_WEIGHT_BLOCK = 128
# Bytes of one top-k index read with each selected row (int32).
INDEX_BYTES = 4
# Bytes of one activation value (bf16 query / output) in the roofline.
ACTIVATION_BYTES = 2
# Pages of a request that HiSparse never releases (docs/design.md §6.1: the two newest).
TAIL_PAGES = 2


def normalize_kv_dtype(kv_dtype: str) -> str:
    """Canonical KV dtype name ("fp8", "bf16" or "fp32") for any accepted spelling.

    Raises:
      ValueError: an unknown name.
    """
    try:
        return _KV_DTYPE_ALIASES[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; choose one of {sorted(_KV_DTYPE_ALIASES)}") from None


# ----------------------------------------------------------------------------- per-token bytes

def mla_row_bytes(cfg: GlmConfig, kv_dtype: str = "fp8") -> int:
    """Bytes of one cached MLA latent row `[c_kv | k_pe]` (one token, one layer).

    fp8 (`fp8_ds_mla`, docs/design.md §4.2): A e4m3 values + one fp32 scale per 128-value tile + R bf16
    rope values = A + 4·A/128 + 2·R (656 for GLM-5.3). bf16: 2·(A+R) = 1152. fp32: 4·(A+R).

    Raises:
      ValueError: unknown dtype, or fp8 with kv_lora_rank not a multiple of 128.
    """
    d = normalize_kv_dtype(kv_dtype)
    a, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if d == "fp8":
        if a % FP8_TILE:
            raise ValueError(f"fp8_ds_mla needs kv_lora_rank a multiple of {FP8_TILE}, got {a}")
        return a + 4 * (a // FP8_TILE) + 2 * r
    return (2 if d == "bf16" else 4) * (a + r)


def indexer_row_bytes(cfg: GlmConfig, kv_dtype: str = "fp8") -> int:
    """Bytes of one cached indexer key (one token, one full layer).

    fp8 (docs/design.md §4.2): Dk e4m3 values + one fp32 scale = Dk + 4 (132 for GLM-5.3).
    bf16: 2·Dk = 256. fp32: 4·Dk.
    """
    d = normalize_kv_dtype(kv_dtype)
    dk = cfg.index_head_dim
    if d == "fp8":
        return dk + 4
    return (2 if d == "bf16" else 4) * dk


@dataclass(frozen=True)
class KVBytesPerToken:
    """Per-token KV bytes of each cache group (bytes per token, summed over the group's layers).

    mla: backbone MLA latent rows (num_hidden_layers rows). indexer: backbone indexer keys (full
    layers only). mtp_mla / mtp_indexer: the MTP layers' own latent rows and indexer keys (0 when
    the MTP layer is not counted). The row sizes and layer counts are kept for printing the sum.
    """

    kv_dtype: str
    mla_row: int
    indexer_row: int
    num_layers: int
    num_indexer_layers: int
    num_mtp_layers: int

    @property
    def mla(self) -> int:
        """Backbone sparse-MLA bytes per token (78 · 656 = 51,168 for GLM-5.3 fp8)."""
        return self.num_layers * self.mla_row

    @property
    def indexer(self) -> int:
        """Backbone indexer bytes per token (21 · 132 = 2,772)."""
        return self.num_indexer_layers * self.indexer_row

    @property
    def mtp_mla(self) -> int:
        """MTP layers' MLA bytes per token (656 with one MTP layer)."""
        return self.num_mtp_layers * self.mla_row

    @property
    def mtp_indexer(self) -> int:
        """MTP layers' indexer bytes per token (132 with one MTP layer)."""
        return self.num_mtp_layers * self.indexer_row

    @property
    def mtp(self) -> int:
        """The MTP layers' bytes per token, MLA plus indexer (788 for GLM-5.3 fp8)."""
        return self.mtp_mla + self.mtp_indexer

    @property
    def total(self) -> int:
        """Everything a device-resident request holds per token (54,728 for GLM-5.3 fp8 + MTP)."""
        return self.mla + self.indexer + self.mtp

    @property
    def sparse_mla(self) -> int:
        """All sparse-MLA layers per token, MTP included: what the HiSparse host pool holds
        (79 · 656 = 51,824)."""
        return self.mla + self.mtp_mla

    @property
    def device_indexer(self) -> int:
        """All indexer keys per token, MTP included: what stays on the device under HiSparse
        (22 · 132 = 2,904)."""
        return self.indexer + self.mtp_indexer

    def formula(self) -> str:
        """The sum written out, e.g. `78·656 + 21·132 + 788 = 54,728 B`."""
        s = f"{self.num_layers}·{self.mla_row} + {self.num_indexer_layers}·{self.indexer_row}"
        if self.num_mtp_layers:
            s += f" + {self.mtp}"
        return f"{s} = {self.total:,} B"


def kv_bytes_per_token(cfg: GlmConfig, kv_dtype: str = "fp8", with_mtp: bool = True) -> KVBytesPerToken:
    """Per-token KV bytes of every group of `cfg` stored as `kv_dtype` (docs/design.md §3.4, §4.2).

    with_mtp: count the MTP layers' own KV (the reference figure 54,728 does; an engine allocates
    it only when it runs MTP speculation).
    """
    d = normalize_kv_dtype(kv_dtype)
    return KVBytesPerToken(
        kv_dtype=d,
        mla_row=mla_row_bytes(cfg, d),
        indexer_row=indexer_row_bytes(cfg, d),
        num_layers=cfg.num_hidden_layers,
        num_indexer_layers=len(cfg.full_layers),
        num_mtp_layers=cfg.num_mtp_layers if with_mtp else 0,
    )


def request_kv_bytes(cfg: GlmConfig, num_tokens: int, kv_dtype: str = "fp8", with_mtp: bool = True,
                     dcp: int = 1) -> int:
    """KV bytes one request of `num_tokens` tokens holds on each device (⌈L / dcp⌉ · B).

    1,048,576 tokens of GLM-5.3 fp8: 57,386,467,328 B = 54,728 MiB ≈ 53.4 GiB; DCP8: ≈ 6.7 GiB.
    """
    if dcp < 1:
        raise ValueError(f"dcp must be >= 1, got {dcp}")
    return math.ceil(num_tokens / dcp) * kv_bytes_per_token(cfg, kv_dtype, with_mtp).total


# ----------------------------------------------------------------------------- accelerators

@dataclass(frozen=True)
class Accelerator:
    """One device: HBM bytes, dense BF16 FLOP/s and HBM bandwidth (bytes/s)."""

    name: str
    hbm_bytes: int
    bf16_flops: float
    hbm_bandwidth: float

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte where the roofline turns from bandwidth- to compute-bound
        (bf16_flops / hbm_bandwidth; 989e12 / 4.8e12 ≈ 206 for the H200, source)."""
        return self.bf16_flops / self.hbm_bandwidth


# H200 SXM: 143,771 MiB of HBM as the driver reports it (141 GB class), 989 TFLOP/s dense BF16
# (the datasheet's 1,979 assumes 2:4 sparsity), 4.8 TB/s (source).
H200 = Accelerator("H200", hbm_bytes=143_771 * MiB, bf16_flops=989e12, hbm_bandwidth=4.8e12)


# ----------------------------------------------------------------------------- weights

# Tensors split over TP (column/row-parallel in vLLM's DeepSeek/GLM modules, vocab-parallel
# embedding and head). Routed experts split over EP; everything else (q_a/kv_a projections, the
# indexer, norms, the router, eh_proj) is replicated.
_TP_SHARDED = frozenset({"q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                         "lm_head"})


@dataclass(frozen=True)
class WeightBytes:
    """Checkpoint bytes split by how the parallel layout shards them."""

    replicated: int
    tp_sharded: int
    expert_sharded: int

    @property
    def total(self) -> int:
        """All checkpoint bytes."""
        return self.replicated + self.tp_sharded + self.expert_sharded

    def per_device(self, tp: int, ep: int) -> int:
        """A checkpoint-file estimate: replicated + TP-sharded / tp + routed experts / ep. The
        planner's per-device figure is `weight_bytes_per_gpu` (the model's parameter tree)."""
        return self.replicated + math.ceil(self.tp_sharded / tp) + math.ceil(self.expert_sharded / ep)


@functools.lru_cache(maxsize=16)
def checkpoint_weight_bytes(cfg: GlmConfig, checkpoint_dtype: str = "fp8", include_mtp: bool = True) -> WeightBytes:
    """Bytes of the HF checkpoint of `cfg` (glm53.checkpoint_keys), split by sharding — the files on
    disk. What a device holds comes from the model's parameter tree instead (`weight_bytes_per_gpu`,
    glm53.weight_bytes): the model replicates the embeddings that `per_device` counts as TP-split.

    fp8 (docs/design.md §3.7): every quantised linear is 1 B per weight plus one fp32 scale per 128×128
    block; embeddings, head, norms, router (fp32), eh_proj and indexer weights_proj/k_norm keep
    their dtype. bf16: the checkpoint as listed (router fp32). GLM-5.3 fp8: ≈ 704 GiB in all.
    """
    from glm53.checkpoint_keys import expected_checkpoint_shapes
    from glm53.quant import is_quantized_linear

    if checkpoint_dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"checkpoint dtype {checkpoint_dtype!r} not one of {CHECKPOINT_DTYPES}")
    rep = tp = ep = 0
    for name, (shape, dtype) in expected_checkpoint_shapes(cfg, include_mtp=include_mtp).items():
        parts = name.split(".")
        module = parts[-2]
        n = math.prod(shape)
        if checkpoint_dtype == "fp8" and is_quantized_linear(name, len(shape)):
            b = FP8_WEIGHT_BLOCK
            nbytes = n + 4 * math.ceil(shape[0] / b) * math.ceil(shape[1] / b)
        else:
            nbytes = n * (4 if dtype == "float32" else 2)
        if ".mlp.experts." in name:
            ep += nbytes
        elif module in _TP_SHARDED:
            tp += nbytes
        else:
            rep += nbytes
    return WeightBytes(replicated=rep, tp_sharded=tp, expert_sharded=ep)


# ----------------------------------------------------------------------------- deployments

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


# ----------------------------------------------------------------------------- roofline

@dataclass(frozen=True)
class Roofline:
    """Sparse-MLA decode/prefill cost of one query token over K selected rows with `heads` heads.

    row_bytes: per selected row (MLA row + int32 index; 660). head_bytes: per head (bf16 query
    A+R wide and output A wide; 2,176). flops_per_row_head: 2·(A+R) + 2·A (2,176).
    """

    heads: int
    topk: int
    row_bytes: int
    head_bytes: int
    flops_per_row_head: int

    @property
    def bytes(self) -> int:
        """Bytes moved per query token: K · row_bytes + heads · head_bytes (1.37 MB at 8 heads)."""
        return self.topk * self.row_bytes + self.heads * self.head_bytes

    @property
    def flops(self) -> int:
        """FLOPs per query token: heads · K · flops_per_row_head (35.7 MFLOP at 8 heads)."""
        return self.heads * self.topk * self.flops_per_row_head

    @property
    def intensity(self) -> float:
        """FLOPs per byte (≈26 at 8 heads, ≈191 at 64; source)."""
        return self.flops / self.bytes


def sparse_mla_roofline(cfg: GlmConfig, heads: int, kv_dtype: str = "fp8", topk: int | None = None) -> Roofline:
    """The sparse-MLA roofline of one query token (source, docs/design.md §9): rows of `mla_row_bytes` +
    a 4-byte index; per head a bf16 query (A+R) and output (A); QK over A+R and PV over A
    at 2 FLOPs per multiply-add."""
    a, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return Roofline(
        heads=heads,
        topk=cfg.index_topk if topk is None else topk,
        row_bytes=mla_row_bytes(cfg, kv_dtype) + INDEX_BYTES,
        head_bytes=ACTIVATION_BYTES * ((a + r) + a),
        flops_per_row_head=2 * (a + r) + 2 * a,
    )


def indexer_crossover_tokens(cfg: GlmConfig, heads_per_device: int) -> float:
    """Prompt length S (tokens) at which a device's indexer prefill FLOPs overtake its sparse-MLA
    FLOPs, prefilling from scratch.

    Counting rule (docs/design.md §9 asks for one): the indexer scores every causal query-key pair at
    2 · I · Dk FLOPs (I heads of Dk dims; causal halving: S²/2 pairs per S queries), sparse MLA
    costs `flops_per_row_head` (2,176) per selected row per head for K rows per query (K ≪ S;
    the first K queries, which see fewer rows, are ignored). A device computes both for the same
    queries (all of them under TP, which replicates the indexer and splits heads; its own 1/N
    under PCP N, with all heads), so the query share cancels: S = K · 2,176 · heads / (I · Dk).
    GLM-5.3: TP8 (8 heads per device) ≈ 8.7K tokens, PCP8 (64 heads) ≈ 70K. The source quotes
    ≈32K and ≈256K; the 8× ratio between the two holds either way.
    """
    rl = sparse_mla_roofline(cfg, heads_per_device)
    return heads_per_device * rl.topk * rl.flops_per_row_head / (cfg.index_n_heads * cfg.index_head_dim)


# ----------------------------------------------------------------------------- engine units

def pages_per_request(groups, num_tokens: int) -> dict[str, int]:
    """Pages each KV cache group needs for `num_tokens` positions: ⌈L / tokens_per_page_g⌉.

    groups: a `glm53.kv_layout.KVCacheLayout` or any iterable of objects with `name` and
    `tokens_per_page` (e.g. `serving.kv_cache.KVCacheGroupSpec`).
    """
    gs = getattr(groups, "groups", groups)
    return {g.name: math.ceil(num_tokens / g.tokens_per_page) for g in gs}


def predict_device_resident_requests(layout, num_blocks: int, max_model_len: int) -> int:
    """How many equal requests of `max_model_len` tokens fit in the engine's arena at once.

    Every request holds ⌈L / tpp_g⌉ pages in each group g of `layout` (pages of all groups come
    from one pool; docs/design.md §6.1.1); block 0 is the null block, so `num_blocks − 1` pages are
    usable: ⌊(num_blocks − 1) / Σ_g ⌈L / tpp_g⌉⌋. (A request that reaches L tokens has written
    KV for L − 1 positions; the two counts differ only when L ≡ 1 mod some tpp_g.)
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    per_req = sum(pages_per_request(layout, max_model_len).values())
    return (num_blocks - 1) // per_req


@dataclass(frozen=True)
class HiSparsePagePlan:
    """HiSparse capacity in arena pages (engine units).

    first_pages: the admitted request fully resident plus its hot lease. steady_pages: another
    request's indexer/other resident groups + hot lease + tail pages. device_bound / host_bound:
    request counts (host_bound None without a host pool size).
    """

    first_pages: int
    steady_pages: int
    hot_pages: int
    device_bound: int
    host_bound: int | None

    @property
    def requests(self) -> int:
        """min(device_bound, host_bound) (device_bound alone without a host pool size)."""
        return self.device_bound if self.host_bound is None else min(self.device_bound, self.host_bound)


def predict_hisparse_requests(layout, num_blocks: int, max_model_len: int, hot_rows: int,
                              host_blocks: int | None = None, offloaded: tuple[str, ...] = ("mla",),
                              tail_pages: int = TAIL_PAGES, reserve_pages: int = 0, reserve_per_request: int = 0,
                              window_tokens: int | None = None, prefill_hot_rows: int | None = None,
                              hot_tokens_per_page: int | None = None) -> HiSparsePagePlan:
    """docs/design.md §9's HiSparse device-bound and host-bound counts in pages of `layout`.

    The `offloaded` groups (the sparse-MLA group) keep only `tail_pages` pages per request on
    the device, plus a hot lease of ⌈hot_rows / tpp⌉ pages of the first offloaded group (hot
    pages are indexed by token row); every other group stays fully resident. Device-bound:
    1 + ⌊(usable − reserve − first) / (steady + reserve_per_request)⌋ (0 if the first request
    does not fit; `reserve_pages` / `reserve_per_request`: headroom the engine keeps free for
    the running requests' growth while it admits another — `HiSparsePolicy` keeps one page per
    running request). Host-bound: ⌊host_blocks / Σ_offloaded ⌈L / tpp_g⌉⌋ when `host_blocks`
    (pages of the host pool) is given.

    This is the engine's admission rule (`serving/hisparse/residency.py`): a request is admitted
    when it fits fully resident (with its lease) next to the others at their steady footprint
    and the reserve. A request that cannot be fully resident even in an empty pool is admitted
    with an in-flight window instead: the offloaded groups' pages of `window_tokens` tokens (the
    engine: two prefill chunks) and a prefill hot buffer of `prefill_hot_rows` rows, next to the
    other groups' pages of the whole context (without `window_tokens`, such a request gives 0).

    Under decode context parallelism pass the engine's pages (`g · N` tokens) as `layout` and
    `hot_tokens_per_page = g`: a leased engine page is a `g`-row page on each of the N ranks, and
    every rank's hot buffer must hold `hot_rows` rows (any rank may own a whole top-k), so the
    lease is ⌈hot_rows / g⌉ engine pages — N times the single-device hot rows over the group.
    """
    pages = pages_per_request(layout, max_model_len)
    gs = {g.name: g for g in getattr(layout, "groups", layout)}
    unknown = [g for g in offloaded if g not in gs]
    if unknown or not offloaded:
        raise ValueError(f"offloaded groups {offloaded} not all in the layout's {sorted(gs)}")
    hot_tpp = hot_tokens_per_page or gs[offloaded[0]].tokens_per_page
    hot_pages = math.ceil(hot_rows / hot_tpp)
    usable = num_blocks - 1
    first = sum(pages.values()) + hot_pages
    resident_rest = sum(n for g, n in pages.items() if g not in offloaded)
    if first > usable and window_tokens is not None:  # the in-flight window
        win = pages_per_request([gs[g] for g in offloaded], min(max_model_len, window_tokens))
        pre = math.ceil((prefill_hot_rows or hot_rows) / hot_tpp)
        first = resident_rest + sum(win.values()) + tail_pages * len(offloaded) + max(hot_pages, pre)
    steady = resident_rest + hot_pages + tail_pages * len(offloaded)
    device_bound = 0 if usable < first else 1 + max(0, usable - reserve_pages - first) // (steady + reserve_per_request)
    host_bound = None
    if host_blocks is not None:
        host_bound = host_blocks // sum(pages[g] for g in offloaded)
    return HiSparsePagePlan(first, steady, hot_pages, device_bound, host_bound)


def engine_capacity_summary(layout, num_blocks: int, max_model_len: int, max_num_seqs: int | None = None, *,
                            dcp: int = 1, dp: int = 1) -> str:
    """One log line: how many requests of `max_model_len` tokens the engine's pool holds
    device-resident (`predict_device_resident_requests`), with the pages each one needs.

    Under decode context parallelism (`dcp` ranks) an engine page spans `tokens_per_page × dcp`
    tokens (each rank stores its share in its own arena shard, `num_blocks` pages per rank), so a
    request needs ⌈L / (tpp_g · dcp)⌉ engine pages per group; with `dp` data-parallel replicas
    (each with its own pool of `num_blocks` pages and its own `max_num_seqs`) the engine holds `dp`
    times one replica's count. Bytes per token are per device (the DCP shares split them).
    """
    if dcp < 1 or dp < 1:
        raise ValueError(f"dcp and dp must be >= 1, got dcp={dcp}, dp={dp}")
    groups = [_EnginePageGroup(g.name, g.tokens_per_page * dcp) for g in layout.groups]
    pages: Mapping[str, int] = pages_per_request(groups, max_model_len)
    n = predict_device_resident_requests(groups, num_blocks, max_model_len) * dp
    per_tok = sum(g.bytes_per_token for g in layout.groups) / dcp
    where = []
    if dcp > 1:
        where.append(f"DCP {dcp}: a page spans {dict((g.name, g.tokens_per_page) for g in groups)} tokens")
    if dp > 1:
        where.append(f"{dp} data-parallel replicas, each with its own pool")
    s = (f"KV capacity: {n} requests of {max_model_len} tokens fit device-resident "
         f"({sum(pages.values())} pages each: {dict(pages)}; {num_blocks - 1} usable pages of "
         f"{layout.page_bytes / MiB:.2f} MiB{' per DCP rank' if dcp > 1 else ''}"
         f"{' per replica' if dp > 1 else ''}; {per_tok:,.0f} B/token per device"
         f"{'; ' + '; '.join(where) if where else ''})")
    if max_num_seqs is not None:
        cap_seqs = max_num_seqs * dp
        s += f"; running at once ≤ min({n}, --max-num-seqs {max_num_seqs}{f' × {dp}' if dp > 1 else ''}) = " \
             f"{min(n, cap_seqs)}"
    return s


@dataclass(frozen=True)
class _EnginePageGroup:
    """A KV group in engine pages (`name`, `tokens_per_page` of one engine page)."""

    name: str
    tokens_per_page: int
