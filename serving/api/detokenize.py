"""Kept for imports: the incremental detokenizer lives in `serving.detokenize` (shared by the
server and the offline `LLM`)."""

from serving.detokenize import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
