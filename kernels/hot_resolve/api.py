"""Dispatch for the hot-buffer resolver (placeholder until the Pallas kernel lands)."""

from kernels.hot_resolve.reference import hot_resolve_reference


def hot_resolve(*args, tokens_per_page: int, implementation: str | None = None, interpret: bool = False):
    return hot_resolve_reference(*args, tokens_per_page=tokens_per_page)
