"""Byte layout of the paged KV arena shared by every KV cache group.

The device holds ONE arena `kv_arena: uint32[num_blocks, page_words]` of equal-size pages
(docs/design.md §6.1.1). Each KV cache group (MLA latent, indexer keys, MTP, later HiSparse hot leases)
draws pages from the same arena and chooses its own `tokens_per_page` so that its page fits:
capacity given up by one group is usable by another. A block id names the same page in every
layer of its group.

Inside a page of a group, data is laid out component-major, then layer, then token, then word:

    word offset of (component c, layer l, token-in-page o) = base[c] + (l * tokens_per_page + o) * row_words[c]

A *slot* is `block * tokens_per_page + o` (vLLM's slot_mapping convention). Block 0 is the null
block: rows in it are absent for readers and writes to it are dropped. Slot −1 means no entry.

Rows are stored as uint32 words; `row_dtype` says how a row decodes (byte layouts in
`kernels/paged/fp8.py` for the fp8 ones):

    row_dtype                 words per row         bytes at full size
    "float32"                 W                     4·W
    "bfloat16"                W/2 (value 2i low)    2·W (1152 for the 576-wide MLA row)
    "fp8_ds_mla"              A/4 + A/128 + R/2     656 (A=512 e4m3 in 128-tiles, 4 fp32 scales, R=64 bf16)
    "fp8_per_token"           Dk/4 + 1              132 (Dk=128 e4m3, one fp32 scale)
    "fp8_per_token_hadamard"  Dk/4 + 1              132, keys rotated by the Hadamard matrix first

(`fp8_ds_mla` needs the component's `rope_dim` = R; A = width − R.)

Segments. A row may be split into segments stored in separate regions of the page: within the
(component, layer) region of `tokens_per_page · row_words` words, segment s of every token comes
before segment s+1 of any token. Word offset of (component c, layer l, token o, segment s):

    base[c] + l * tokens_per_page * row_words[c] + tokens_per_page * sum(seg[c][:s]) + o * seg[c][s]

A one-segment row reduces to the formula above. `fp8_per_token*` keys have two segments (Dk/4
code words, 1 scale word): per page and layer all the tokens' keys first, then all their scales
(docs/design.md §4.2): keys sit Dk bytes apart (16-byte aligned at Dk = 128 when the page is) and the
scales are contiguous, ready for vector loads.
`fp8_ds_mla` rows are one 656-byte segment (41 × 16 B), like the format it follows.
Gathers return, and scatters take, the logical row (segments concatenated in order).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.paged.fp8 import fp8_ds_mla_words, fp8_key_segments

ROW_DTYPES = ("float32", "bfloat16", "fp8_ds_mla", "fp8_per_token", "fp8_per_token_hadamard")
FP8_KEY_DTYPES = ("fp8_per_token", "fp8_per_token_hadamard")


def row_segments(width: int, row_dtype: str, rope_dim: int = 0) -> tuple[int, ...]:
    """Word counts of the segments of a row of `width` values stored as `row_dtype`.

    `rope_dim` (fp8_ds_mla only): trailing values kept as bf16. Raises ValueError for an unknown
    row dtype or a width the format cannot hold.
    """
    if row_dtype == "float32":
        return (width,)
    if row_dtype == "bfloat16":
        if width % 2:
            raise ValueError(f"bfloat16 rows need an even width, got {width}")
        return (width // 2,)
    if row_dtype == "fp8_ds_mla":
        return (fp8_ds_mla_words(width - rope_dim, rope_dim),)
    if row_dtype in FP8_KEY_DTYPES:
        return fp8_key_segments(width)
    raise ValueError(f"unknown row dtype {row_dtype!r}; expected one of {ROW_DTYPES}")


def row_words(width: int, row_dtype: str, rope_dim: int = 0) -> int:
    """Number of uint32 words for a row of `width` values stored as `row_dtype`."""
    return sum(row_segments(width, row_dtype, rope_dim))


@dataclass(frozen=True)
class CacheComponent:
    """One per-layer row type of a group: `num_layers` layers of `width`-value rows.

    rope_dim: for `fp8_ds_mla`, the trailing values stored as bf16 (R); must be 0 otherwise.
    """

    name: str
    num_layers: int
    width: int
    row_dtype: str
    rope_dim: int = 0

    def __post_init__(self):
        if self.rope_dim and self.row_dtype != "fp8_ds_mla":
            raise ValueError(f"{self.name}: rope_dim is only meaningful for fp8_ds_mla rows")
        row_segments(self.width, self.row_dtype, self.rope_dim)  # validate early

    @property
    def segments(self) -> tuple[int, ...]:
        """Word counts of the row's segments (see the module docstring)."""
        return row_segments(self.width, self.row_dtype, self.rope_dim)

    @property
    def row_words(self) -> int:
        return sum(self.segments)


@dataclass(frozen=True)
class GroupLayout:
    """Where a group's rows live inside an arena page (hashable: a static jit argument)."""

    name: str
    tokens_per_page: int
    components: tuple[CacheComponent, ...]

    @property
    def words_per_page(self) -> int:
        """Words this group actually uses in a page (<= the arena's page_words)."""
        return sum(c.num_layers * self.tokens_per_page * c.row_words for c in self.components)

    def component(self, name: str) -> tuple[int, CacheComponent]:
        """(base word offset in the page, component) for a component name."""
        base = 0
        for c in self.components:
            if c.name == name:
                return base, c
            base += c.num_layers * self.tokens_per_page * c.row_words
        raise KeyError(f"group {self.name!r} has no component {name!r}")

    @property
    def bytes_per_token(self) -> int:
        return sum(4 * c.num_layers * c.row_words for c in self.components)


def fit_tokens_per_page(page_words: int, components: tuple[CacheComponent, ...], granule: int = 64) -> int:
    """Largest multiple of `granule` tokens whose rows (all components, all layers) fit a page."""
    per_token = sum(c.num_layers * c.row_words for c in components)
    n = (page_words // per_token) // granule * granule
    if n < granule:
        raise ValueError(f"a page of {page_words} words cannot hold {granule} tokens of {per_token} words")
    return n
