"""Lightning-indexer top-k over the paged indexer-key cache."""

from kernels.indexer_topk.api import indexer_topk

__all__ = ["indexer_topk"]
