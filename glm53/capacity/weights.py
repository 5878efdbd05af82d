"""Checkpoint weight bytes of GLM-5.x, split by how a parallel layout shards them (replicated,
over TP, over EP)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from glm53.capacity.kv_bytes import (
    CHECKPOINT_DTYPES,
    FP8_WEIGHT_BLOCK,
)

from glm53.config import GlmConfig

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
