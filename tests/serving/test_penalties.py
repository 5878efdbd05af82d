"""Presence, frequency and repetition penalties and `logit_bias` in the engine (serving/penalties.py,
`glm53.sampling.apply_penalties`), greedy, synchronous and with asynchronous scheduling.

Oracle (`tests/helpers/penalties_oracle.py`), independent of the engine's paged step and its
sparse lists: one full forward of the prompt and the engine's output, and at each output position
vLLM's definitions transcribed densely in NumPy over the whole vocabulary
(`tests/glm53/test_sampling_penalties.py` checks the same maths on the device function). The
engine's token must be the oracle's argmax, or within 1e-3 of its adjusted logit (a near-tie
between the two computations' summation orders). The reported logprobs are those of the raw
distribution (vLLM's default), compared with the oracle's log-softmax. On the tiny checkpoint's
7-layer twin.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm53 import api
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.types import InvalidRequestError, SamplingParams
from tests.helpers.penalties_oracle import check_greedy_stream

pytestmark = pytest.mark.shallow_model

P, N = 24, 10  # prompt and output lengths (equal for every request: the oracle compiles one forward)
PROMPT = [int(t) for t in np.random.default_rng(3).integers(10, 400, P)]
ADJUST = {
    "plain": {},
    "repetition": {"repetition_penalty": 0.5},  # < 1 favours seen ids: the random-weight model repeats none
    # the bias puts id 42 first; a penalty above 1 then keeps it from repeating (the model's top
    # logit is about 3, (x + 6) / 4 stays under it)
    "bias_only": {"logit_bias": {42: 6.0}},
    "repetition_above_1": {"logit_bias": {42: 6.0}, "repetition_penalty": 4.0},
    # negative values favour ids already generated (the plain stream repeats none)
    "frequency_presence": {"frequency_penalty": -1.5, "presence_penalty": -0.5},
    "bias_and_all": {"logit_bias": {17: 4.0, 33: 2.5, 200: -100.0}, "frequency_penalty": 0.5,
                     "repetition_penalty": 0.7, "presence_penalty": -0.4},
}


@pytest.fixture(scope="module")
def lm():
    return api.load()


@pytest.fixture(scope="module")
def engine():
    e = build_engine(EngineArgs(max_model_len=128, max_num_seqs=6, max_num_batched_tokens=64, cuda_graph_sizes=[],
                                precompile_token_paddings=[], compile_progress=False, disable_log_stats=True))
    yield e
    assert not e.has_unfinished_requests() and e.audit() == []
    assert e.pool.num_free == e.pool.num_usable_blocks, "KV pages leaked"


def run(e, requests: dict, async_scheduling: bool):
    """{id: SamplingParams} on PROMPT to the end → ({id: tokens}, {id: [TokenLogprobs]})."""
    if async_scheduling or e.drafts is None:
        e.set_async_scheduling(async_scheduling)
    for rid, sp in requests.items():
        e.add_request(rid, PROMPT, sp)
    toks, lps = {r: [] for r in requests}, {r: [] for r in requests}
    while e.has_unfinished_requests():
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.new_logprobs or []
        assert e.audit() == []
    return toks, lps


@pytest.mark.parametrize("mode", ["sync", "async", "one_program"])
def test_greedy_streams_follow_vllms_penalties_and_the_logprobs_stay_raw(engine, lm, mode, monkeypatch):
    """sync: each step with such rows runs the forward pass, then the sampler program with the
    lists; async: the same, its sampler deferred until the step in flight is read back;
    one_program: the lists passed to the whole step program, as a multi-process engine (which
    cannot split its steps) runs them, forced here on one process."""
    async_scheduling = mode == "async"
    if mode == "one_program":
        monkeypatch.setattr(type(engine.runner), "can_defer_sampling", property(lambda self: False))
    deferred = engine.runner.num_deferred_samples
    requests = {name: SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=1, **adj)
                for name, adj in ADJUST.items()}
    toks, lps = run(engine, requests, async_scheduling)
    if mode == "one_program":
        assert any(k[0] and "penalized" in k[0] for k in engine.runner._first_use_programs), \
            engine.runner._first_use_programs
    reachable = engine.runner.sampling_vocab_size
    for name, adj in ADJUST.items():
        assert len(toks[name]) == N
        check_greedy_stream(lm, PROMPT, toks[name], adj, reachable, lps[name])
        base = {"plain": None, "repetition_above_1": "bias_only"}.get(name, "plain")
        if base is not None:
            assert toks[name] != toks[base], f"{name} changed nothing: the check would be vacuous"
    assert 200 not in toks["bias_and_all"]
    if async_scheduling:
        # the counts need the token of the step in flight: those steps' samplers ran after it
        assert engine.runner.num_deferred_samples > deferred
        sync, _ = run(engine, requests, False)
        assert sync == toks


def test_a_seeded_draw_repeats_and_a_large_bias_decides_it(engine):
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=N, ignore_eos=True, frequency_penalty=1.0,
                            repetition_penalty=1.3)
    forced = SamplingParams(temperature=1.0, seed=5, max_tokens=N, ignore_eos=True, logit_bias={42: 100.0},
                            presence_penalty=2.0)
    a, _ = run(engine, {"s": seeded, "f": forced}, False)
    b, _ = run(engine, {"s": seeded, "f": forced}, True)
    assert a["s"] == b["s"] and len(set(a["s"])) > 1
    # +100 outweighs the presence penalty's −2 and any difference of the tiny model's logits
    assert a["f"] == b["f"] == [42] * N


def test_refusals_name_the_field(engine):
    with pytest.raises(InvalidRequestError, match=r"logit_bias token id 99999 is outside the vocabulary") as e:
        engine.add_request("x", PROMPT, SamplingParams(logit_bias={99999: 1.0}))
    assert e.value.param == "logit_bias"
    for bad, words in (({"presence_penalty": 2.5}, "presence_penalty must be in"),
                       ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
                       ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
                       ({"logit_bias": {"7": 1.0}}, "logit_bias maps token ids"),
                       ({"logit_bias": {7: float("inf")}}, "logit_bias maps token ids")):
        with pytest.raises(ValueError, match=words):
            engine.add_request("x", PROMPT, SamplingParams(**bad))
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def mtp_engine():
    e = build_engine(EngineArgs(max_model_len=128, max_num_seqs=6, max_num_batched_tokens=64, cuda_graph_sizes=[],
                                precompile_token_paddings=[], compile_progress=False, disable_log_stats=True,
                                speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    yield e
    assert not e.has_unfinished_requests() and e.audit() == []
    assert e.pool.num_free == e.pool.num_usable_blocks, "KV pages leaked"


def test_mtp_verification_rows_count_the_drafts_before_them(engine, mtp_engine, lm):
    """Under MTP speculation (k = 2) verification row j's penalties count the output and the j
    drafts before it. Drafts taken from the non-speculative run are all accepted, so the emitted
    tokens come from rows after drafts (each must count them); then the MTP layer's own drafts.
    Both streams against the oracle, and the first equal to the non-speculative run's."""
    requests = {name: SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=1, **adj)
                for name, adj in ADJUST.items()}
    ref, _ = run(engine, requests, False)
    e = mtp_engine
    reachable = e.runner.sampling_vocab_size
    e.drafter_override = lambda req, n: (ref[req.request_id][req.num_output_tokens:] + [0] * n)[:n]
    drafted, accepted = e.spec_stats.num_draft_tokens, e.spec_stats.num_accepted_tokens
    try:
        got, lps = run(e, requests, False)
    finally:
        e.drafter_override = None
    drafted, accepted = e.spec_stats.num_draft_tokens - drafted, e.spec_stats.num_accepted_tokens - accepted
    assert accepted == drafted > len(ADJUST) * (N // 2)  # every draft accepted, most tokens emitted after drafts
    assert got == ref
    for name, adj in ADJUST.items():
        check_greedy_stream(lm, PROMPT, got[name], adj, reachable, lps[name])
    own, lps = run(e, requests, False)
    for name, adj in ADJUST.items():
        check_greedy_stream(lm, PROMPT, own[name], adj, reachable, lps[name])


def test_the_kept_list_equals_one_built_from_scratch():
    """`PenaltyState` updated token by token (new ids inserted in order, drafts given columns)
    gives the lists a fresh state gives for the same output, at every length."""
    from serving.penalties import PenaltyState
    from serving.request import Request

    rng = np.random.default_rng(7)
    sp = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={3: 1.0, 450: -2.0})
    req = Request("r", rng.integers(0, 500, 40).tolist(), sp)
    kept = PenaltyState(req)
    for step in range(30):
        req.output_token_ids += rng.integers(0, 500, int(rng.integers(1, 4))).tolist()
        kept.update(req.output_token_ids)
        drafts = rng.integers(0, 500, 2).tolist()
        fresh = PenaltyState(req)
        fresh.update(req.output_token_ids)
        a, b = kept.entries(drafts), fresh.entries(drafts)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        ids, per_pos, in_prompt, bias = a
        for j in range(3):  # position j: the output's counts plus drafts[:j]
            want = [(req.output_token_ids + drafts[:j]).count(int(t)) for t in ids]
            assert per_pos[j].tolist() == want
        assert in_prompt.tolist() == [int(t) in req.prompt_token_ids for t in ids]
        assert bias.tolist() == [{3: 1.0, 450: -2.0}.get(int(t), 0.0) for t in ids]
