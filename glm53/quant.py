"""FP8 weights kept on the device: which parameters are block-scaled, their block sizes, and the
checks a parallel layout must pass.

Format (DeepSeek-V3 / GLM-5.x FP8 checkpoints, docs/design.md §3.7): a quantised linear's HF weight
`[out, in]` is float8_e4m3fn with an fp32 `weight_scale_inv [ceil(out/b0), ceil(in/b1)]`
(`weight_block_size [b0, b1]`, GLM-5.3 [128, 128]); the real weight is the code × its block's
scale. The model stores linear weights `[in, out]` (glm53/layers.py), so a kept weight is the
transposed codes with the transposed scale grid, block `(b1, b0)` over `[in, out]`
(`kernels.fp8_matmul`'s convention).

Quantised (every linear of attention and FFN): `q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`,
`kv_b_proj` (kept split as `w_uk`/`w_uv`), `o_proj`, the indexer's `wq_b` and `wk`, the dense
MLP, the shared experts and the routed experts. Not quantised (kept in the model dtype, the
router in fp32): embeddings, `lm_head`, norms, the router, the MTP `eh_proj`, the indexer's
`weights_proj` and `k_norm` — as in the checkpoint.

Where a split cuts a scale block:
* `kv_b_proj [N·(dn+dv), A]` is split per head into `w_uk [N, dn, A]` and `w_uv [N, A, dv]`.
  GLM-5.3's head is dn + dv = 448 rows = 3.5 blocks of 128 and dn = 192 = 1.5 blocks, so the
  split cuts blocks. The codes are kept as they are and the scale grid is refined along the rows
  to `g = gcd(b0, dn, dv)` rows (GLM-5.3: 64): each 128-row block's scale is repeated for its two
  64-row halves, which the head and nope/value boundaries never cut. Exact (the same real
  weights); costs 2× the (tiny) kv_b scale bytes: `[N, dn/g, ceil(A/b1)]` for w_uk and
  `[N, ceil(A/b1), dv/g]` for w_uv.
* Tensor / expert-column parallelism splits a quantised weight's output (q_b_proj, gate/up,
  expert gate/up) or input (o_proj, down, expert down) dimension. A shard must hold whole scale
  blocks: `check_fp8_parallel_layout` refuses a layout whose shard width is not a multiple of the
  block (vLLM refuses the same; GLM-5.3 is aligned up to TP16). Expert parallelism splits whole
  experts and never cuts a block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from glm53.config import GlmConfig
from kernels.fp8_matmul.reference import scale_shape  # noqa: F401  (re-exported for the model)

QUANTIZATION_METHODS = ("fp8",)
# Modules whose `.weight` is a block-scaled FP8 linear in GLM-5.x FP8 checkpoints (docs/design.md §3.7).
QUANTIZED_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk", "gate_proj",
                     "up_proj", "down_proj")


def is_quantized_linear(key: str, ndim: int) -> bool:
    """Whether the HF tensor `key` (with `ndim` dims) is one GLM-5.x FP8 checkpoints store as
    e4m3 + `weight_scale_inv`: attention projections, the indexer's wq_b/wk, dense MLP, shared and
    routed experts — not the router (`mlp.gate`), `eh_proj`, `weights_proj`, embeddings, head."""
    return key.endswith(".weight") and ndim == 2 and key.split(".")[-2] in QUANTIZED_LINEARS


class QuantizationError(ValueError):
    """A quantisation request that cannot apply (the message names the flag or the config key)."""


@dataclass(frozen=True)
class WeightQuant:
    """Block-scaled FP8 weights kept on the device.

    block: the checkpoint's `weight_block_size [b0, b1]` over HF `[out, in]` weights.
    online: True when the checkpoint is not FP8 and the loader quantises it (`--quantization fp8`).
    """

    block: tuple[int, int] = (128, 128)
    online: bool = False

    @property
    def linear_block(self) -> tuple[int, int]:
        """Block over a model weight `[in, out]`: `(b1, b0)`."""
        return (self.block[1], self.block[0])

    def kv_b_row_block(self, cfg: GlmConfig) -> int:
        """Rows per scale block of the refined `kv_b_proj` grid: gcd(b0, dn, dv)."""
        return math.gcd(self.block[0], cfg.qk_nope_head_dim, cfg.v_head_dim)

    def w_uk_block(self, cfg: GlmConfig) -> tuple[int, int]:
        """Block of `w_uk [N, dn, A]` over its last two dims: (g, b1)."""
        return (self.kv_b_row_block(cfg), self.block[1])

    def w_uv_block(self, cfg: GlmConfig) -> tuple[int, int]:
        """Block of `w_uv [N, A, dv]` over its last two dims: (b1, g)."""
        return (self.block[1], self.kv_b_row_block(cfg))


def checkpoint_block(cfg: GlmConfig) -> tuple[int, int] | None:
    """The FP8 block of the checkpoint's `quantization_config`, or None for an unquantised one.

    Raises QuantizationError for a quantisation method or format this build cannot load."""
    q = cfg.quantization_config
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise QuantizationError(f"the checkpoint's quantization_config.quant_method is {method!r}; only 'fp8' "
                                "(block-scaled e4m3) checkpoints are supported")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"the checkpoint's FP8 format is {fmt!r}; only e4m3 is supported")
    block = q.get("weight_block_size")
    if block is None:
        raise QuantizationError("the FP8 checkpoint has no quantization_config.weight_block_size: only "
                                "block-scaled FP8 checkpoints (e.g. [128, 128]) are supported")
    if len(block) != 2 or min(block) < 1:
        raise QuantizationError(f"quantization_config.weight_block_size {block} must be two positive sizes")
    return (int(block[0]), int(block[1]))


def resolve_weight_quant(cfg: GlmConfig, quantization: str | None) -> WeightQuant | None:
    """What the loader does with the weights, from the checkpoint and `--quantization`.

    quantization: None (vLLM's default: an FP8 checkpoint is served as FP8, any other as stored),
      "fp8" (FP8 weights on the device; a bf16/fp32 checkpoint is quantised at load to 128×128
      blocks), or "none" (Python API only: dequantise an FP8 checkpoint to the model dtype, the
      comparison baseline).
    Raises QuantizationError naming `--quantization` for an unknown method, or the checkpoint's
    `quantization_config` for a method this build cannot load.
    """
    if quantization not in (None, "none", *QUANTIZATION_METHODS):
        raise QuantizationError(f"--quantization {quantization!r} is not supported; choose from "
                                f"{list(QUANTIZATION_METHODS)}")
    block = checkpoint_block(cfg)
    if quantization == "none":
        return None
    if block is not None:
        return WeightQuant(block=block)
    if quantization == "fp8":
        return WeightQuant(block=(128, 128), online=True)
    return None


def check_fp8_parallel_layout(cfg: GlmConfig, quant: WeightQuant | None, sizes) -> None:
    """Refuse a parallel layout whose shards would cut FP8 scale blocks.

    sizes: `role -> number of shards` (`ParallelLayout.size`), for the roles ATTN_HEADS,
    MLP_COLS and EXPERT_COLS. Raises QuantizationError naming the parameter, the shard width, the
    block and `--tensor-parallel-size`.
    """
    if quant is None:
        return
    from sharding.mesh import ATTN_HEADS, EXPERT_COLS, MLP_COLS

    b_out, b_in = quant.block
    N = cfg.num_attention_heads
    checks = [
        ("q_b_proj output", N * cfg.qk_head_dim, sizes(ATTN_HEADS), b_out),
        ("o_proj input", N * cfg.v_head_dim, sizes(ATTN_HEADS), b_in),
        ("dense MLP gate/up output and down input", cfg.intermediate_size, sizes(MLP_COLS), math.lcm(b_out, b_in)),
        ("shared expert gate/up output and down input", cfg.moe_intermediate_size * max(1, cfg.n_shared_experts),
         sizes(MLP_COLS), math.lcm(b_out, b_in)),
        ("routed expert gate/up output and down input", cfg.moe_intermediate_size, sizes(EXPERT_COLS),
         math.lcm(b_out, b_in)),
    ]
    for what, width, n, b in checks:
        if n > 1 and (width % n or (width // n) % b):
            ep = " (or --enable-expert-parallel, which splits whole experts)" if what.startswith("routed") else ""
            raise QuantizationError(
                f"FP8 weights: the {what} ({width}) split {n} ways gives {width / n:g} per device, not a multiple of "
                f"the {b}-wide scale block; choose a --tensor-parallel-size whose shards hold whole blocks{ep}")
