"""Per-token KV bytes of GLM-5.x and the byte constants of the planner (docs/design.md §4.2).

* MLA latent row per layer: `fp8_ds_mla` = A + 4·A/128 + 2·R (656 B for A = 512, R = 64: 512 e4m3
  values, 4 fp32 tile scales, 64 bf16 rope values); bf16 = 2·(A+R) (1152 B); fp32 = 4·(A+R).
* Indexer key per full layer: fp8 = Dk + 4 (132 B: 128 e4m3 values and one fp32 scale);
  bf16 = 2·Dk (256 B); fp32 = 4·Dk.
* The MTP layer has its own MLA row and its own indexer key: 656 + 132 = 788 B.

GLM-5.3 with FP8 KV: 78·656 + 21·132 + 788 = 54,728 B per token; a 1,048,576-token request holds
54,728 MiB ≈ 53.4 GiB, and ≈ 6.7 GiB per device when DCP8 shards it over 8 devices (source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
