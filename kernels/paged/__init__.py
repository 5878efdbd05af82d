"""Paged KV arena: layout, row formats (float32, bfloat16, fp8) and row access (cache writes,
gathers, position→slot, page copies).

Reading rows inside a kernel: `row_location(slots, layout, component, layer)` gives the page
(block) and the start word of each row segment; load those words (`component.segments` words per
segment) and decode them with the pure 32-bit-jnp decoders: `decode_rows(words, row_dtype,
rope_dim)` on a logical row, or the pieces in `kernels.paged.fp8`
(`decode_fp8_ds_mla_words`, `decode_fp8_key_words(code_words, scale_word)`, `e4m3_decode`,
`decode_bf16_words`). For `fp8_per_token_hadamard` keys, score against `to_key_basis(q, row_dtype)`.
Byte layouts: `layout.py` (segments, offsets) and `fp8.py` (bytes inside a row).
"""

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
    copy_pages,
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
    "copy_pages",
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
