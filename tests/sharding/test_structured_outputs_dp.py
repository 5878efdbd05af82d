"""Structured outputs under data parallelism (DP2 with expert parallelism, 8 simulated devices):
each replica's request rows get their own masks in the stacked step. Constrained requests pinned
to both replicas at temperature 1 all validate, and the same greedy constrained request gives the
same stream on either replica; asynchronous scheduling gives the same streams."""

from __future__ import annotations

import pytest

from glm53.tokenizer import GlmTokenizer
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.structured_outputs import StructuredOutputsParams
from serving.types import SamplingParams
from sharding.mesh import ParallelConfig
from tests.serving.test_structured_outputs import (
    CHOICES,
    MAX_TOKENS,
    PERSON,
    PROMPT,
    REGEXES,
    check_output,
    json_params,
    run,
    text_of,
)

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model


@pytest.fixture(scope="module")
def engine():
    e = build_engine(EngineArgs(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                                cuda_graph_sizes=[], precompile_token_paddings=[], compile_progress=False,
                                disable_log_stats=True,
                                parallel=ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)))
    yield e
    assert not e.has_unfinished_requests() and e.audit() == [] and not e.structured.requests


def test_constrained_requests_on_both_replicas(engine):
    e = engine
    tok = GlmTokenizer.from_pretrained(e.model_path)
    prompt = tok.encode(PROMPT)
    reqs, checks = {}, {}
    for i in range(8):
        kind = ("json", "regex", "choice")[i % 3]
        so = {"json": json_params(PERSON), "regex": StructuredOutputsParams(regex=REGEXES[i % 3]),
              "choice": StructuredOutputsParams(choice=CHOICES)}[kind]
        reqs[f"r{i}"] = SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=so,
                                       data_parallel_rank=i % 2)
        checks[f"r{i}"] = (kind, {"json": PERSON, "regex": REGEXES[i % 3], "choice": CHOICES}[kind])
    for rank in (0, 1):  # the same greedy request on each replica
        reqs[f"g{rank}"] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=json_params(PERSON),
                                          data_parallel_rank=rank)
        checks[f"g{rank}"] = ("json", PERSON)
    toks, reasons, _ = run(e, {rid: (prompt, params) for rid, params in reqs.items()})
    for rid, (kind, spec) in checks.items():
        assert reasons[rid] == "stop", rid
        check_output(kind, spec, text_of(tok, e, toks[rid]))
    assert toks["g0"] == toks["g1"]
    # Asynchronous scheduling: the stacked step's forward pass is dispatched while the constrained
    # step is in flight and sampled after (`ModelRunner.sample_deferred`); the same streams.
    deferred = e.runner.num_deferred_samples
    atoks, areasons, _ = run(e, {rid: (prompt, params) for rid, params in reqs.items()}, async_scheduling=True)
    assert atoks == toks and areasons == reasons
    assert e.runner.num_deferred_samples - deferred > 5


def test_min_tokens_on_both_replicas(engine):
    """min_tokens rides on the replicas' stacked masks: on either replica, a stop token id the
    greedy stream reaches at position p is replaced there by the unconstrained run's second choice
    and the stream runs past min_tokens (with and without asynchronous scheduling)."""
    e = engine
    prompt = [31, 7, 99, 250, 18, 4, 77]
    ref, _, lps = run(e, {f"ref{r}": (prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3,
                                                             data_parallel_rank=r)) for r in (0, 1)})
    toks = ref["ref0"]
    assert ref["ref1"] == toks
    p = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    top = lps["ref0"][p].top
    assert top[0][0] == toks[p] and top[1][1] - top[2][1] > 1e-3  # a clear second choice
    for async_scheduling in (False, True):
        got, _, _ = run(e, {f"m{r}": (prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[toks[p]],
                                                             min_tokens=p + 2, data_parallel_rank=r))
                            for r in (0, 1)}, async_scheduling=async_scheduling)
        for r in (0, 1):
            g = got[f"m{r}"]
            assert g[:p] == toks[:p] and g[p] == top[1][0] and toks[p] not in g[: p + 2], (async_scheduling, r, g)
