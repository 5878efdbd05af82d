"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`, serving/prompt_logprobs.py) in the
engine and the offline `LLM`, synchronous and with asynchronous scheduling.

Oracle (tests/helpers/prompt_logprobs_oracle.py), independent of the engine's paged, chunked step:
one full forward of the prompt on a fresh cache (`glm53.api.forward`) and the log-softmax of its
logits in float64 over the reachable ids. Each prompt token's logprob must match to 2e-4
(summation orders differ), its rank must lie within the oracle's ranks of ids tied with it to
1e-4, and the top alternatives must be the oracle's k most likely up to such ties. On the tiny
checkpoint's 7-layer twin. (Under HiSparse, where chunks cut short are computed again:
tests/serving/test_hisparse_engine.py; data and prefill context parallelism:
tests/sharding/test_engine_dp.py, test_engine_parallel.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

from glm53 import api
from serving import step_program
from serving.llm import LLM
from serving.types import InvalidRequestError, SamplingParams
from tests.helpers.prompt_logprobs_oracle import check_prompt_logprobs

pytestmark = pytest.mark.shallow_model

rng = np.random.default_rng(11)
LONG = [int(t) for t in rng.integers(10, 400, 150)]  # three prefill chunks of the 64-token budget
SHORT = [int(t) for t in rng.integers(10, 400, 20)]


@pytest.fixture(scope="module")
def lm():
    return api.load()


@pytest.fixture(scope="module")
def llm():
    # Blocks of 16 rows instead of 256 (read when a program is traced): a 64-token step holds four,
    # and a chunk of fewer rows (the last of LONG's, SHORT's) computes the first and skips the rest.
    mp = pytest.MonkeyPatch()
    mp.setattr(step_program, "PROMPT_LOGPROBS_BLOCK", 16)
    e = LLM(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, cuda_graph_sizes=[],
            precompile_token_paddings=[], compile_progress=False, disable_log_stats=True, enable_prefix_caching=True)
    yield e
    engine = e.engine
    assert not engine.has_unfinished_requests() and engine.audit() == []
    assert engine.pool.num_free == engine.pool.num_usable_blocks, "KV pages leaked"
    assert not engine._prompt_logprob_requests, "prompt-logprob requests kept after their output"
    mp.undo()


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Submit, step to the end → {id: (output tokens, prompt logprobs, num_cached_tokens)}."""
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
    got = {rid: [[], None, None] for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            g = got[o.request_id]
            g[0] += o.new_token_ids
            if o.prompt_logprobs is not None:
                assert g[1] is None, "prompt logprobs sent twice"
                g[1] = o.prompt_logprobs
            g[2] = o.num_cached_tokens
        assert engine.audit() == []
    return {rid: tuple(v) for rid, v in got.items()}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_follow_one_full_forward(llm, lm, async_scheduling):
    """A 150-token prompt over three chunks (k = 5) and a 20-token one (k = 0, with output
    logprobs) in the same steps as a request without them, after the long prompt was cached: the
    entries follow the oracle, the request read nothing from the prefix cache (a plain repeat
    does), and asking for prompt logprobs changes no output token."""
    e = llm.engine
    e.set_async_scheduling(async_scheduling)
    greedy = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    first = run(e, {"warm": (LONG, SamplingParams(**greedy))})
    got = run(e, {
        "long": (LONG, SamplingParams(**greedy, prompt_logprobs=5)),
        "short": (SHORT, SamplingParams(**greedy, prompt_logprobs=0, logprobs=2)),
        "plain": (LONG, SamplingParams(**greedy)),
    })
    reachable = e.runner.sampling_vocab_size
    check_prompt_logprobs(lm, LONG, got["long"][1], 5, reachable)
    check_prompt_logprobs(lm, SHORT, got["short"][1], 0, reachable)
    assert got["plain"][1] is None and got["plain"][2] > 0  # the prefix cache holds LONG's pages
    assert got["long"][2] == 0  # … which the prompt-logprob request did not read
    assert got["long"][0] == got["plain"][0] == first["warm"][0]


def test_one_token_prompt_and_the_offline_llm(llm, lm):
    """`LLM.generate` returns the prompt logprobs (vLLM's `RequestOutput.prompt_logprobs`); a
    one-token prompt has nothing to predict: [None]."""
    out = llm.generate([SHORT, [SHORT[0]]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)
    check_prompt_logprobs(lm, SHORT, out[0].prompt_logprobs, 3, llm.engine.runner.sampling_vocab_size)
    assert out[1].prompt_logprobs == [None]
    plain = llm.generate([SHORT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert plain[0].prompt_logprobs is None and plain[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_refusals_name_the_field_and_leave_nothing_behind(llm):
    e = llm.engine
    cases = [
        (SamplingParams(prompt_logprobs=e.args.max_logprobs + 1), "exceeds the maximum"),
        (SamplingParams(prompt_logprobs=1, kv_transfer_params={"do_remote_decode": True}), "kv_transfer_params"),
    ]
    for sp, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg) as ei:
            e.add_request("bad", SHORT, sp)
        assert ei.value.param == "prompt_logprobs"
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        e.add_request("bad", SHORT, SamplingParams(prompt_logprobs=-1))
    assert not e.has_unfinished_requests() and not e._prompt_logprob_requests


def test_the_whole_step_program_computes_them_too(llm, lm, monkeypatch):
    """Where a step cannot run split (MTP speculation, a multi-process engine: their followers run
    whole steps), the whole step program takes the rows (its "+prompt-logprobs" variant), forced
    here on one process: the same entries. (MTP across two processes:
    tests/sharding/test_multihost.py.)"""
    e = llm.engine
    e.set_async_scheduling(False)
    monkeypatch.setattr(type(e.runner), "can_defer_sampling", property(lambda self: False))
    got = run(e, {"long": (LONG, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2,
                                                presence_penalty=0.5))})  # penalties: the whole step too
    check_prompt_logprobs(lm, LONG, got["long"][1], 2, e.runner.sampling_vocab_size)
    assert ("penalized64+prompt-logprobs", 64, True) in e.runner._first_use_programs


def test_an_aborted_request_is_forgotten(llm):
    e = llm.engine
    e.add_request("gone", LONG, SamplingParams(max_tokens=4, prompt_logprobs=2))
    e.step()  # its first chunk
    assert e.abort("gone") is not None
    while e.has_unfinished_requests():  # (a step in flight under asynchronous scheduling)
        e.step()
    assert not e._prompt_logprob_requests
    assert e.pool.num_free == e.pool.num_usable_blocks
