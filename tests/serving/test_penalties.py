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
from serving.types import InvalidRequestError, ReasoningTags, SamplingParams
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
        assert bias[0].tolist() == [{3: 1.0, 450: -2.0}.get(int(t), 0.0) for t in ids]


def _budget_oracle(opened: bool, budget: int, tokens: list[int], tags) -> list[bool]:
    """Written out: position j is forced when the tokens before it leave the (one) think block
    open with `budget` or more tokens spent inside it. The block: from the start when the prompt
    opened it, or from a first token that is the start id; to the first end id; no second block."""
    out = []
    for j in range(len(tokens) + 1):
        before = tokens[:j]
        if opened:
            body = before[1:] if before[:1] == [tags.start_id] else before
        elif before[:1] == [tags.start_id]:
            body = before[1:]
        else:
            out.append(False)  # content from the first token (or nothing yet, not opened)
            continue
        closed = tags.end_id in body
        out.append(not closed and len(body) >= budget)
    return out


def test_the_thinking_budget_state_forces_where_the_budget_is_spent():
    """`PenaltyState` kept token by token gives the forced positions (the end id's bias raised by
    FORCE) that the written-out rule gives for the output and each prefix of the drafts."""
    from serving.penalties import FORCE, PenaltyState
    from serving.request import Request

    rng = np.random.default_rng(5)
    for opened in (True, False):
        tags = ReasoningTags(end_id=7, start_id=8, opened=opened)
        sp = SamplingParams(thinking_token_budget=3, reasoning_tags=tags, logit_bias={7: 1.5})
        req = Request("r", [1, 2, 3], sp)
        kept = PenaltyState(req)
        for _ in range(40):
            req.output_token_ids += rng.choice([5, 6, 7, 8], int(rng.integers(1, 3))).tolist()
            kept.update(req.output_token_ids)
            drafts = rng.choice([5, 7, 8], 2).tolist()
            ids, _, _, bias = kept.entries(drafts)
            col = int(np.searchsorted(ids, 7))
            forced = _budget_oracle(opened, 3, req.output_token_ids + drafts, tags)[len(req.output_token_ids):]
            got = [bias[min(j, len(bias) - 1), col] for j in range(3)]
            assert got == [1.5 + FORCE if f else 1.5 for f in forced], (req.output_token_ids, drafts)


END = 42  # stands for </think>: any id serves the engine (the tags are the request's)


@pytest.mark.parametrize("mode", ["sync", "async", "one_program"])
def test_a_thinking_budget_ends_the_block_at_the_budget(engine, mode, monkeypatch):
    """Greedy: the stream equals the unbudgeted one until the budget is spent inside the block,
    then the end id comes; what follows is the model's own continuation of that prefix (the
    same request without a budget on the prompt extended by it). Opened by the prompt or by a
    start id the model emits."""
    if mode == "one_program":
        monkeypatch.setattr(type(engine.runner), "can_defer_sampling", property(lambda self: False))
    plain, _ = run(engine, {"p": SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)}, False)
    plain = plain["p"]
    assert END not in plain  # (so the block never closes by itself: every cut below is the budget's)
    start = plain[0]  # the model's first token taken as the start id: the block opens with it
    cases = {"opened": (ReasoningTags(END, None, True), 4, 4), "zero": (ReasoningTags(END, None, True), 0, 0),
             "emitted_start": (ReasoningTags(END, start, False), 2, 3)}  # opened by token 0; 2 spent at 3
    requests = {name: SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, thinking_token_budget=b,
                                     reasoning_tags=tags) for name, (tags, b, _) in cases.items()}
    got, _ = run(engine, requests, mode == "async")
    for name, (_, _, at) in cases.items():
        assert got[name][:at] == plain[:at] and got[name][at] == END, (name, got[name], plain)
        prefix = got[name][:at + 1]
        engine.add_request("c", PROMPT + prefix, SamplingParams(temperature=0, max_tokens=N - at - 1, ignore_eos=True))
        cont = []
        while engine.has_unfinished_requests():
            cont += [t for o in engine.step() for t in o.new_token_ids]
        assert got[name][at + 1:] == cont, (name, got[name], cont)
        assert got[name].count(END) == 1  # forced once: the block is closed for good


def test_a_thinking_budget_under_mtp_forces_the_verification_row_where_it_is_spent(mtp_engine):
    """Under MTP speculation (k = 2) the drafts follow the unbudgeted stream, so the verification
    row where the budget is spent holds a draft other than the end id: that row is forced (the
    draft rejected) and the stream equals the unbudgeted one up to it, then the end id."""
    e = mtp_engine
    plain, _ = run(e, {"p": SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)}, False)
    plain = plain["p"]
    assert END not in plain
    drafted, accepted = e.spec_stats.num_draft_tokens, e.spec_stats.num_accepted_tokens
    cases = {f"b{b}": b for b in (1, 3, 4)}  # forced at several offsets within a draft window
    # drafts from the unbudgeted stream (the random MTP layer's own are never accepted)
    e.drafter_override = lambda req, n: (plain[req.num_output_tokens:] + [0] * n)[:n]
    try:
        got, _ = run(e, {name: SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, thinking_token_budget=b,
                                              reasoning_tags=ReasoningTags(END, None, True))
                         for name, b in cases.items()}, False)
    finally:
        e.drafter_override = None
    for name, b in cases.items():
        assert got[name][:b] == plain[:b] and got[name][b] == END and got[name].count(END) == 1, (name, got[name])
    # drafts were accepted before the forced rows (so rows after drafts were forced too)
    assert e.spec_stats.num_draft_tokens > drafted and e.spec_stats.num_accepted_tokens - accepted >= 3
