"""Block-scaled FP8 weight matmuls (DeepSeek-V3 / GLM-5.3 FP8 checkpoints, DeepGEMM recipe): the
dense projection form and the grouped MoE-expert form, plus the block quantiser."""

from kernels.fp8_matmul.api import IMPLEMENTATIONS, fp8_grouped_matmul, fp8_matmul
from kernels.fp8_matmul.reference import (FP8_MAX, dequantize_fp8_blocks, fp8_grouped_matmul_reference,
                                          fp8_matmul_reference, quantize_fp8_blocks, quantize_fp8_blocks_np)

__all__ = ["FP8_MAX", "IMPLEMENTATIONS", "dequantize_fp8_blocks", "fp8_grouped_matmul", "fp8_grouped_matmul_reference",
           "fp8_matmul", "fp8_matmul_reference", "quantize_fp8_blocks", "quantize_fp8_blocks_np"]
