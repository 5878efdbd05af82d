"""The model's KV cache groups laid out in one paged arena (docs/design.md §4, §6.1.1).

Groups (each draws pages from the same arena; a block id names the page in every layer):

* `mla`     — the MLA latent rows `[c_kv | k_pe]` (A+R wide) of every sparse-MLA layer: the
              backbone's layers 0 … L−1, then, with MTP, the MTP layers' (layer L …); 64 tokens/page.
* `indexer` — the indexer keys (Dk wide) of the full (indexer-owning) layers, then, with MTP, the
              MTP layers' keys (layer F = len(full_layers) …).

The MTP layers are one more layer of each group (`mtp_mla_layer`, `mtp_index_layer`), as the
reference keeps them: Hybrid HiSparse moves a page's MTP latent rows with its backbone rows (the
host pool row of a token holds all L + 1 layers, and the MTP layer resolves its top-k through
the hot buffer as index group F), and prefix caching, offloading and P/D move them with their
pages. (A group of their own would hold one layer's keys per page: a page of thousands of
tokens, which would set the prefix-cache hit unit.)

The arena page is sized for the `mla` group (64 tokens × all layers); the other groups pick the
largest multiple of 64 tokens per page that fits, as vLLM's hybrid allocator does.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from glm53.config import GlmConfig
from kernels.paged.layout import CacheComponent, GroupLayout, fit_tokens_per_page

MLA_TOKENS_PER_PAGE = 64

# Cache dtype name → (row dtype of the MLA latent rows, row dtype of the indexer keys)
# (byte layouts in kernels/paged/layout.py and kernels/paged/fp8.py). "fp8" is the production
# format of docs/design.md §4.2: fp8_ds_mla latent rows (656 B/token/layer at full size) and e4m3 indexer
# keys with one fp32 scale per token (132 B), Hadamard-rotated (docs/design.md §3.3) unless disabled.
CACHE_ROW_DTYPES = {
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "fp8": ("fp8_ds_mla", "fp8_per_token_hadamard"),
}


@dataclass(frozen=True)
class KVCacheLayout:
    """Static description of the arena: page size and each group's layout (hashable)."""

    page_words: int
    groups: tuple[GroupLayout, ...]

    def group(self, name: str) -> GroupLayout:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no KV cache group {name!r}")

    @property
    def page_bytes(self) -> int:
        return 4 * self.page_words

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def empty_arena(self, num_blocks: int, device=None):
        """A zeroed arena `uint32[num_blocks, page_words]` (block 0 is the null block)."""
        import jax

        arr = jnp.zeros((num_blocks, self.page_words), jnp.uint32)
        return jax.device_put(arr, device) if device is not None else arr


def build_kv_layout(cfg: GlmConfig, cache_dtype: str = "float32", with_mtp: bool = True, *,
                    indexer_hadamard: bool = True) -> KVCacheLayout:
    """Lay out the groups of `cfg` for rows stored as `cache_dtype` ("float32", "bfloat16" or "fp8").

    indexer_hadamard: with "fp8", rotate the indexer keys (and queries) by the Hadamard matrix
    before quantising (needs a power-of-two index_head_dim); ignored for the other dtypes.
    Raises ValueError for an unknown cache dtype or widths the fp8 formats cannot hold
    (kv_lora_rank not a multiple of 128, odd qk_rope_head_dim, index_head_dim not a multiple of 4).
    """
    if cache_dtype not in CACHE_ROW_DTYPES:
        raise ValueError(f"cache dtype {cache_dtype!r} not supported; choose one of {sorted(CACHE_ROW_DTYPES)}")
    mla_rd, idx_rd = CACHE_ROW_DTYPES[cache_dtype]
    if idx_rd == "fp8_per_token_hadamard" and not indexer_hadamard:
        idx_rd = "fp8_per_token"
    rope = cfg.qk_rope_head_dim if mla_rd == "fp8_ds_mla" else 0

    def mla_rows(n):
        return CacheComponent("mla", n, cfg.mla_row_width, mla_rd, rope_dim=rope)

    def index_keys(n):
        return CacheComponent("indexer", n, cfg.index_head_dim, idx_rd)

    n_mtp = cfg.num_mtp_layers if with_mtp else 0
    mla = mla_rows(cfg.num_hidden_layers + n_mtp)
    page_words = mla.num_layers * MLA_TOKENS_PER_PAGE * mla.row_words
    groups = [GroupLayout("mla", MLA_TOKENS_PER_PAGE, (mla,))]
    idx = (index_keys(len(cfg.full_layers) + n_mtp),)
    groups.append(GroupLayout("indexer", fit_tokens_per_page(page_words, idx), idx))
    return KVCacheLayout(page_words=page_words, groups=tuple(groups))


def mtp_mla_layer(cfg: GlmConfig, i: int = 0) -> int:
    """Layer index, in the `mla` group, of MTP layer `i`'s latent rows (after the backbone's L)."""
    return cfg.num_hidden_layers + i


def mtp_index_layer(cfg: GlmConfig, i: int = 0) -> int:
    """Layer index, in the `indexer` group, of MTP layer `i`'s keys (after the F full layers'); also
    its HiSparse hot-state index group."""
    return len(cfg.full_layers) + i


def mtp_layers_in(layout: KVCacheLayout, cfg: GlmConfig) -> int:
    """How many MTP layers' rows `layout` holds (0 unless built with `with_mtp`): the `mla` group's
    layers past the backbone's L."""
    return max(0, layout.group("mla").component("mla")[1].num_layers - cfg.num_hidden_layers)


def layout_has_mtp(layout: KVCacheLayout, cfg: GlmConfig) -> bool:
    """True when `layout` holds the MTP layers' rows (built with `with_mtp`)."""
    return mtp_layers_in(layout, cfg) > 0
