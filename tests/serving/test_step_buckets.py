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


def test_skip_precompile_compiles_each_program_on_first_use(monkeypatch):
    """`skip_precompile` (or SKIP_JAX_PRECOMPILE=1, which the suite sets): building the engine
    compiles no step program; the first prefill step compiles the prefill bucket only, the first
    decode step the decode bucket; the tokens equal an engine that compiled every bucket first."""
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.types import SamplingParams

    def run(skip: bool):
        monkeypatch.setenv("SKIP_JAX_PRECOMPILE", "1" if not skip else "0")  # the argument decides over it
        e = build_engine(EngineArgs(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, cuda_graph_sizes=[2],
                                    precompile_token_paddings=[], compile_progress=False, disable_log_stats=True,
                                    skip_precompile=skip))
        assert e.runner.buckets == (2, 32)
        sizes = [e.runner._step._cache_size()]  # compiled step programs after the build
        e.add_request("r", list(range(5, 30)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        toks = []
        while e.has_unfinished_requests():
            for o in e.step():
                toks += o.new_token_ids
            sizes.append(e.runner._step._cache_size())
        return toks, sizes

    lazy_toks, lazy_sizes = run(True)
    eager_toks, eager_sizes = run(False)
    assert lazy_sizes[0] == 0 and lazy_sizes[1] == 1 and lazy_sizes[-1] == 2  # prefill, then decode bucket
    assert set(eager_sizes) == {2}
    assert lazy_toks == eager_toks and len(lazy_toks) == 6


def test_skip_precompile_environment_variable(monkeypatch):
    from serving.engine_args import EngineArgs, skip_precompile_requested

    for value, want in (("", False), ("0", False), ("1", True), ("true", True)):
        monkeypatch.setenv("SKIP_JAX_PRECOMPILE", value)
        assert skip_precompile_requested(EngineArgs()) is want
    assert skip_precompile_requested(EngineArgs(skip_precompile=False)) is False  # set: the argument wins
    monkeypatch.delenv("SKIP_JAX_PRECOMPILE")
    assert skip_precompile_requested(EngineArgs(skip_precompile=True)) is True
