"""Host-memory transfers, each with an XLA memory-kind mechanism and a host-callback one: for
HiSparse the write-through page store and the host → hot-row copy (`gather_host_rows`); for the
KV offloading connector whole-page stores and loads (`store_arena_pages`, `load_arena_pages`)."""

from kernels.host_rows.api import default_mechanism
from kernels.host_rows.ops import (HOST_RUN_SIZES, MECHANISMS, HostRowStore, column_part, copy_host_rows,
                                   host_reads, join_column_parts, load_arena_pages, page_to_rows, read_host_rows,
                                   rows_moved, run_left, scatter_host_rows, sort_misses, split_words,
                                   store_arena_pages, store_pages)

__all__ = ["HOST_RUN_SIZES", "MECHANISMS", "HostRowStore", "column_part", "copy_host_rows", "default_mechanism",
           "host_reads", "join_column_parts", "load_arena_pages", "page_to_rows", "read_host_rows", "rows_moved",
           "run_left", "scatter_host_rows", "sort_misses", "split_words", "store_arena_pages", "store_pages"]
