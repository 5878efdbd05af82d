"""The accelerators the planner knows: HBM bytes, dense BF16 FLOP/s and HBM bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

from glm53.capacity.kv_bytes import (
    MiB,
)


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
