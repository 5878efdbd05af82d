"""Roofline of sparse MLA (source): a selected row is 656 + 4 (int32 index) = 660 B; each head adds a
bf16 query (A+R wide) and output (A wide), 2,176 B, and costs 2·(A+R) + 2·A = 2,176 FLOPs per row.
Per query token with h heads: bytes = K·660 + h·2,176, FLOPs = h·K·2,176 → ≈26 FLOPs/B at 8
heads (TP8), ≈191 at 64 (PCP). H200 ridge: 989 TFLOP/s dense BF16 ÷ 4.8 TB/s ≈ 206 FLOPs/B.
"""

from __future__ import annotations

from dataclasses import dataclass

from glm53.capacity.kv_bytes import (
    ACTIVATION_BYTES,
    INDEX_BYTES,
    mla_row_bytes,
)

from glm53.config import GlmConfig


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
