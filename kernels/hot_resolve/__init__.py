"""HiSparse hot-buffer resolver: top-k positions → arena slots (resident in place, or through a
per-request hot buffer with LRU replacement) plus the host → hot row copies to run."""

from kernels.hot_resolve.api import dropped_selections, hot_resolve

__all__ = ["dropped_selections", "hot_resolve"]
