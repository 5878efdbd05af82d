"""Paged KV arena: layout, row formats (float32, bfloat16, fp8) and row access (cache writes,
gathers, position→slot)."""

from kernels.paged.layout import (
    FP8_KEY_DTYPES,
    ROW_DTYPES,
    CacheComponent,
    GroupLayout,
    fit_tokens_per_page,
    row_segments,
    row_words,
)
from kernels.paged.ops import (
    decode_rows,
    encode_rows,
    gather_rows,
    positions_to_slots,
    read_cache,
    row_location,
    scatter_rows,
    slot_valid,
    to_key_basis,
    write_cache,
)

__all__ = [
    "FP8_KEY_DTYPES",
    "ROW_DTYPES",
    "CacheComponent",
    "GroupLayout",
    "fit_tokens_per_page",
    "row_segments",
    "row_words",
    "decode_rows",
    "encode_rows",
    "gather_rows",
    "positions_to_slots",
    "read_cache",
    "row_location",
    "scatter_rows",
    "slot_valid",
    "to_key_basis",
    "write_cache",
]
