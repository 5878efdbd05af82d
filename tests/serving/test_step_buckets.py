"""Step token buckets: decode sizes next to the prefill sizes, never past the step budget."""

from __future__ import annotations

import pytest

from serving.cli_args import ArgumentError, make_arg_parser, validate_args
from serving.step_buckets import (
    cuda_graph_sizes,
    default_cuda_graph_sizes,
    token_buckets,
)


def test_default_buckets_hold_decode_sizes():
    # Batch B of pure decode schedules B tokens: 1, 8 and 32 run in steps of exactly that size.
    assert token_buckets(512, default_cuda_graph_sizes(32)) == (1, 2, 4, 8, 16, 32, 64, 256, 512)
    assert default_cuda_graph_sizes(24) == (1, 2, 4, 8, 16, 24)
    assert default_cuda_graph_sizes(8, multiple_of=4) == (4, 8)  # prefill context parallel 2
    assert token_buckets(64, ()) == (16, 64)  # the prefill buckets alone, as before


def test_buckets_never_pass_the_budget():
    # A budget below the decode sizes: they are dropped and the budget is the largest bucket.
    assert token_buckets(6, default_cuda_graph_sizes(32)) == (1, 2, 4, 6)
    assert token_buckets(100, (3, 100, 200)) == (3, 16, 64, 100)
    for budget in (1, 7, 16, 17, 300):
        b = token_buckets(budget, default_cuda_graph_sizes(64))
        assert b[-1] == budget and list(b) == sorted(set(b)) and all(x <= budget for x in b)
    with pytest.raises(ValueError, match="cuda-graph-sizes"):
        token_buckets(64, (0, 8))


def test_cuda_graph_sizes_flag():
    parse = make_arg_parser().parse_args
    assert cuda_graph_sizes(parse([]).cuda_graph_sizes) is None  # default set
    assert cuda_graph_sizes(parse(["--cuda-graph-sizes"]).cuda_graph_sizes) == ()
    assert cuda_graph_sizes(parse(["--cuda-graph-sizes", "12"]).cuda_graph_sizes) == (1, 2, 4, 8, 12)
    assert cuda_graph_sizes(parse(["--cuda-graph-sizes", "3", "40"]).cuda_graph_sizes) == (3, 40)
    with pytest.raises(ArgumentError, match="--cuda-graph-sizes"):
        validate_args(parse(["--cuda-graph-sizes", "0"]))


def test_precompile_token_paddings_replace_the_prefill_sizes():
    # The prefill ladder 16·4^k is replaced by the given sizes; () leaves the budget alone.
    assert token_buckets(512, (), ()) == (512,)
    assert token_buckets(512, (1, 2), ()) == (1, 2, 512)
    assert token_buckets(512, (4,), (128, 300, 1024)) == (4, 128, 300, 512)
    with pytest.raises(ValueError, match="precompile-token-paddings"):
        token_buckets(64, (), (0,))
    parse = make_arg_parser().parse_args
    assert parse([]).precompile_token_paddings is None
    assert parse(["--precompile-token-paddings"]).precompile_token_paddings == []
    assert parse(["--precompile-token-paddings", "32", "128"]).precompile_token_paddings == [32, 128]
    with pytest.raises(ArgumentError, match="--precompile-token-paddings"):
        validate_args(parse(["--precompile-token-paddings", "0"]))
