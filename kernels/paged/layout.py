"""Byte layout of the paged KV arena shared by every KV cache group.

The device holds ONE arena `kv_arena: uint32[num_blocks, page_words]` of equal-size pages
(DESIGN §6.1.1). Each KV cache group (MLA latent, indexer keys, MTP, later HiSparse hot leases)
draws pages from the same arena and chooses its own `tokens_per_page` so that its page fits:
capacity given up by one group is usable by another. A block id names the same page in every
layer of its group.

Inside a page of a group, data is laid out component-major, then layer, then token, then word:

    word offset of (component c, layer l, token-in-page o) = base[c] + (l * tokens_per_page + o) * row_words[c]

A *slot* is `block * tokens_per_page + o` (vLLM's slot_mapping convention). Block 0 is the null
block: rows in it are absent for readers and writes to it are dropped. Slot −1 means no entry.

Rows are stored as uint32 words; `row_dtype` says how a row decodes ("float32": one value per
word, "bfloat16": two values per word). The fp8 formats of the kernel issue are further
`row_dtype`s over the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

ROW_DTYPES = ("float32", "bfloat16")


def row_words(width: int, row_dtype: str) -> int:
    """Number of uint32 words for a row of `width` values stored as `row_dtype`."""
    if row_dtype == "float32":
        return width
    if row_dtype == "bfloat16":
        if width % 2:
            raise ValueError(f"bfloat16 rows need an even width, got {width}")
        return width // 2
    raise ValueError(f"unknown row dtype {row_dtype!r}; expected one of {ROW_DTYPES}")


@dataclass(frozen=True)
class CacheComponent:
    """One per-layer row type of a group: `num_layers` layers of `width`-value rows."""

    name: str
    num_layers: int
    width: int
    row_dtype: str

    @property
    def row_words(self) -> int:
        return row_words(self.width, self.row_dtype)


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
