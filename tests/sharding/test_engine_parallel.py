"""The engine under parallel layouts serves the single-device greedy streams (docs/design.md §10 rule).

The shipped tiny checkpoint (4 heads, 8 experts) through `LLMEngine` with continuous batching and
chunked prefill (budget 64 tokens, so the 100-token prompt is prefilled in chunks and decode steps
mix with prefill chunks); prompts longer than index_topk = 64 make the indexer select. Layouts:
TP2 × DCP2 with the a2a backend (engine pages of 128 tokens) and PCP4 × DCP4 × EP4 (the prefill
engine's shape: load-balanced token split, sharded cache with a temporary full copy, experts over
all devices). Equality rule: streams identical, except a divergence at a near-tie (top-2 logit gap
of the single-device model below 1e-4 at the first differing token), which is reported.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm53 import api
from serving.engine import EngineArgs, LLMEngine
from serving.engine_factory import build_engine
from serving.types import SamplingParams
from sharding.mesh import ParallelConfig
from tests.helpers.drafts import record_drafts
from tests.helpers.prompt_logprobs_oracle import check_prompt_logprobs

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

PROMPTS = {"a": list(range(5, 25)), "b": [(7 * i) % 300 + 4 for i in range(70)],
           "c": [(13 * i) % 400 + 4 for i in range(100)]}
MAX_TOKENS = 6
EPS = 1e-4


def build(parallel: ParallelConfig | None, speculative_config=None) -> LLMEngine:
    # Under PCP a 16-token bucket besides the 64-token one: PCP4 splits it into chunks of 2 tokens
    # in load-balanced order, so a decode step of 3 requests moves the third one's row (token 2 →
    # row 4), which asynchronous scheduling's token feed must follow.
    pcp = parallel is not None and parallel.prefill_context_parallel_size > 1
    args = EngineArgs(dtype="float32", max_model_len=192, max_num_seqs=4, max_num_batched_tokens=64,
                      num_gpu_blocks_override=24, compile_progress=False, parallel=parallel,
                      cuda_graph_sizes=[], precompile_token_paddings=[16] if pcp else [],
                      speculative_config=speculative_config)
    return build_engine(args)


def run(engine: LLMEngine, audit_each_step: bool = True) -> dict:
    """PROMPTS to the end (greedy, ignore_eos); audit after every step (or only at the end)."""
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    streams = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams[out.request_id].extend(out.new_token_ids)
        if audit_each_step:
            assert engine.audit() == []
    assert engine.audit() == []
    return streams


def serve(parallel: ParallelConfig | None, engine_out: list | None = None):
    engine = build(parallel)
    dcp = parallel.decode_context_parallel_size if parallel is not None else 1
    assert (engine.runner.parallel is not None) == (parallel is not None)
    assert engine.kv.group("mla").tokens_per_page == 64 * dcp  # engine pages span 64 × DCP tokens
    if engine_out is not None:
        engine_out.append(engine)
    return run(engine, audit_each_step=False)


def assert_equal_under_rule(got: dict, single_device_streams: dict) -> None:
    lm = None
    for rid, ref in single_device_streams.items():
        assert len(got[rid]) == len(ref) == MAX_TOKENS
        if got[rid] == ref:
            continue
        i = next(j for j, (a, b) in enumerate(zip(got[rid], ref)) if a != b)
        lm = lm or api.load()
        row = api.forward(lm, PROMPTS[rid] + ref[:i])[-1]
        top2 = np.sort(row)[-2:]
        print(f"\n{rid}: diverges at token {i} ({got[rid][i]} vs {ref[i]}), top-2 gap {top2[1] - top2[0]:.2e}")
        assert top2[1] - top2[0] < EPS


@pytest.fixture(scope="module")
def single_device_streams():
    return serve(None)


@pytest.mark.parametrize("cfg", [
    ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_comm_backend="a2a"),
    ParallelConfig(prefill_context_parallel_size=4, decode_context_parallel_size=4, enable_expert_parallel=True),
], ids=["tp2_dcp2_a2a", "pcp4_dcp4_ep4"])
def test_served_streams_equal_single_device(cfg, single_device_streams):
    engines = []
    got = serve(cfg, engines)
    assert_equal_under_rule(got, single_device_streams)
    engine = engines[0]
    # Asynchronous scheduling on the same engine (serving/async_scheduling.py): the placeholder
    # tokens are fed on the mesh (under PCP into the load-balanced token order); audited after
    # every step; the same streams.
    engine.set_async_scheduling(True)
    assert run(engine) == got
    assert engine.pool.num_free == engine.pool.num_usable_blocks
    if cfg.prefill_context_parallel_size > 1:
        # Prompt logprobs (serving/prompt_logprobs.py): their rows index the hidden states in the
        # load-balanced token order; two chunks of c's 100 tokens against one full forward.
        engine.add_request("c_plp", PROMPTS["c"], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
        entries = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                entries = out.prompt_logprobs or entries
        check_prompt_logprobs(api.load(), PROMPTS["c"], entries, 1, engine.runner.sampling_vocab_size)


MTP2 = {"method": "mtp", "num_speculative_tokens": 2}


def run_recording_drafts(engine: LLMEngine) -> tuple[dict, dict]:
    """`run` on an MTP engine → (streams, each request's drafts as `(tokens out, drafts)` after
    each step: what the MTP layer proposed)."""
    drafts = record_drafts(engine)
    try:
        return run(engine), drafts
    finally:
        engine.drafter_override = None


@pytest.fixture(scope="module")
def single_device_drafts():
    return run_recording_drafts(build(None, MTP2))[1]


@pytest.mark.parametrize("cfg", [
    ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_comm_backend="a2a"),
    ParallelConfig(prefill_context_parallel_size=4, decode_context_parallel_size=4, enable_expert_parallel=True),
], ids=["tp2_dcp2_a2a", "pcp4_dcp4_ep4"])
def test_mtp_speculation_serves_the_single_device_streams(cfg, single_device_streams, single_device_drafts):
    """MTP speculation (k = 2) under TP2 × DCP2 and under PCP4 × DCP4 × EP4 (the reference's
    prefill engine runs PCP × DCP with MTP3): the k + 1 verification rows are decode rows whose KV
    is spread over the DCP ranks like any decode token's; under PCP the step's rows are in the
    load-balanced order, so the verification rows, the MTP layer's inputs and the accepted rows
    are found through it, and the draft steps' one row per request (5 per step here) is padded to
    a multiple of the 4 PCP ranks. The MTP layer's own drafts (random weights: almost all
    rejected) give the single-device streams without speculation, and every request's drafts
    after every step equal the single-device engine's under the same speculation; an oracle
    drafter (the single-device continuation) makes every decode step verify 3 rows, every draft
    accepted, the same streams."""
    engine = build(cfg, MTP2)
    ref = single_device_streams

    got, drafts = run_recording_drafts(engine)  # the MTP layer's own drafts (random weights: rejected)
    assert got == ref
    assert drafts == single_device_drafts and sum(len(d) for d in drafts.values()) > 2 * len(PROMPTS)
    s = engine.spec_stats
    assert s.num_draft_tokens > 0
    before = (s.num_draft_tokens, s.num_accepted_tokens)
    engine.drafter_override = lambda req, n: (ref[req.request_id][req.num_output_tokens:] + [0] * n)[:n]
    assert run(engine) == ref  # every draft accepted
    assert s.num_draft_tokens > before[0] and s.num_accepted_tokens - before[1] == s.num_draft_tokens - before[0]
    # The start-up compile (which servers run; the suite skips it) builds the padding step.
    engine.runner.compile(progress=False)
    assert set(engine.runner.compile_seconds) == set(engine.runner.buckets)
