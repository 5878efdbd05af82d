"""Paged KV arena: layout and row access (cache writes, gathers, position→slot, page copies)."""

from kernels.paged.layout import CacheComponent, GroupLayout, fit_tokens_per_page, row_words
from kernels.paged.ops import (
    copy_pages,
    decode_rows,
    encode_rows,
    gather_rows,
    positions_to_slots,
    read_cache,
    scatter_rows,
    slot_valid,
    write_cache,
)

__all__ = [
    "copy_pages",
    "CacheComponent",
    "GroupLayout",
    "fit_tokens_per_page",
    "row_words",
    "decode_rows",
    "encode_rows",
    "gather_rows",
    "positions_to_slots",
    "read_cache",
    "scatter_rows",
    "slot_valid",
    "write_cache",
]
