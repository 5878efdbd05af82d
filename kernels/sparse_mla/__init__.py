"""Sparse MLA (absorbed form) over the paged latent cache."""

from kernels.sparse_mla.api import sparse_mla

__all__ = ["sparse_mla"]
