"""Pin the tie order of HF transformers' DSA indexer top-k to ours: higher score first, then lower position.

Why. HF's `GlmMoeDsaIndexer.forward` (transformers 5.23/5.24,
`transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py`) scores the keys as
`I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] / sqrt(index_head_dim))` and returns
`index_scores.topk(min(index_topk, T), dim=-1).indices`. torch documents no order among equal
values, and on CPU the subset of tied keys it keeps depends on the call (the same row gives
different subsets in a `[B, S, T]` full forward and in a `[B, 1, T]` cached decode step). Exact
ties are common with random weights: a key scores exactly 0 whenever every head's dot product is
negative (probability 2^-heads per key, 1/16 with 4 heads), and when no selected key scores below
0 the top-k boundary falls among those zeros. Our tie rule (docs/design.md §3.3) is a total order: higher
score, then lower position. On the tiny checkpoint (4 indexer heads, index_topk 64) HF's
`generate` and HF's own full forward (no cache) then disagree with each other once the context
passes index_topk, and both disagree with us; with this patch all three agree token for token
(`scripts/bench_decode.py` reports both comparisons).

`position_tie_rule()` is a context manager: inside it, every `GlmMoeDsaIndexer.forward` call runs
with `torch.Tensor.topk` replaced by a stable descending sort (values descending, equal values in
ascending index order) truncated to k; HF's scoring maths is untouched. Imports torch and
transformers lazily, so importing this module needs only the standard library.
"""

from __future__ import annotations

from contextlib import contextmanager


def stable_topk(x, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,  # noqa: A002 (torch's name)
                lower_first: bool = True):
    """`torch.topk` with a defined tie order: among equal values the lower index comes first (the
    higher one with `lower_first=False`).

    Returns torch's `topk` named tuple (values, indices), sorted (descending when `largest`).
    """
    import torch

    if not lower_first:
        n = x.shape[dim]
        flipped = stable_topk(x.flip(dim), k, dim, largest, sorted)
        return torch.return_types.topk((flipped.values, n - 1 - flipped.indices))
    order = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((x.gather(dim, order), order))


@contextmanager
def position_tie_rule(lower_first: bool = True):
    """Within the block, HF's DSA indexer breaks top-k ties by lower position (see module docstring;
    by higher position with `lower_first=False`, a deliberately different rule for checking that a
    fixture tells tie rules apart)."""
    import torch
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_mod

    indexer = hf_mod.GlmMoeDsaIndexer
    orig_forward = indexer.forward
    native_topk = torch.Tensor.topk

    def topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002
        return stable_topk(x, k, dim, largest, sorted, lower_first)

    def forward(self, *args, **kwargs):
        torch.Tensor.topk = topk
        try:
            return orig_forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = native_topk

    indexer.forward = forward
    try:
        yield
    finally:
        indexer.forward = orig_forward
