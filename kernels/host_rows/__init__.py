"""Host-pool row transfers for HiSparse: the write-through page store and the host → hot-row
copy (`gather_host_rows`), each with an XLA memory-kind mechanism and a host-callback one."""

from kernels.host_rows.api import default_mechanism
from kernels.host_rows.ops import MECHANISMS, HostRowStore, copy_host_rows, page_to_rows, store_pages

__all__ = ["MECHANISMS", "HostRowStore", "copy_host_rows", "default_mechanism", "page_to_rows", "store_pages"]
