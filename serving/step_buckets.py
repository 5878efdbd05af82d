"""Step token buckets: the token counts the engine compiles its step for at start-up.

A step's token count is padded up to the next bucket, and the largest bucket is
`max_num_batched_tokens`, so a step is never padded past its token budget. The buckets are the
decode sizes (`--cuda-graph-sizes`, by default the powers of two up to `max_num_seqs`: a decode step
of B requests has B tokens) plus the prefill sizes (`--precompile-token-paddings`, by default
16·4^k), all capped at the budget.
"""

from __future__ import annotations


def default_cuda_graph_sizes(max_num_seqs: int, multiple_of: int = 1) -> tuple[int, ...]:
    """Default decode-sized buckets: 1, 2, 4, … up to `max_num_seqs`, and `max_num_seqs` itself.

    A pure-decode step of B requests schedules B tokens, so these let batch B run a step of
    (nearly) B tokens instead of the smallest prefill bucket (vLLM likewise captures its CUDA
    graphs at small decode sizes). Sizes that are not a multiple of `multiple_of` are left out
    (under prefill context parallelism every bucket must split into 2·pcp chunks)."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return tuple(x for x in out if x % multiple_of == 0)


def cuda_graph_sizes(flag_values: list[int] | None) -> tuple[int, ...] | None:
    """`--cuda-graph-sizes` values → the decode bucket list: None (flag absent) → None (the
    default set); [] → (); one value N → 1, 2, 4, … up to N and N; several → those values."""
    if flag_values is None:
        return None
    if len(flag_values) == 1:
        return default_cuda_graph_sizes(flag_values[0])
    return tuple(flag_values)


def token_buckets(max_num_batched_tokens: int, cuda_graph_sizes=(), precompile_token_paddings=None,
                  smallest: int = 16, factor: int = 4) -> tuple[int, ...]:
    """Sorted step sizes in tokens: `cuda_graph_sizes` (decode sizes) ∪ the prefill sizes, every
    one ≤ `max_num_batched_tokens`, and always the budget itself as the largest, so no step is
    padded past its token budget. Sizes above the budget are dropped. The prefill sizes are
    `precompile_token_paddings` (sglang-jax's name; () for none besides the budget) or, when None,
    the geometric 16·4^k.

    Every bucket is one more compiled program (two under Hybrid HiSparse): fewer buckets start
    faster and pad more (a step runs at its bucket's size).

    Raises:
      ValueError: a size < 1."""
    for flag, sizes in (("--cuda-graph-sizes", cuda_graph_sizes), ("--precompile-token-paddings",
                                                                  precompile_token_paddings or ())):
        bad = [s for s in sizes if int(s) < 1]
        if bad:
            raise ValueError(f"{flag} must be >= 1, got {bad}")
    out = {int(s) for s in cuda_graph_sizes if int(s) < max_num_batched_tokens}
    if precompile_token_paddings is not None:
        out |= {int(s) for s in precompile_token_paddings if int(s) < max_num_batched_tokens}
    else:
        b = smallest
        while b < max_num_batched_tokens:
            out.add(b)
            b *= factor
    out.add(max_num_batched_tokens)
    return tuple(sorted(out))
