"""Structured outputs under MTP speculation (k = 2): each verified position is masked with the
grammar's state after the drafts before it, so a draft the grammar forbids is rejected and
speculation never emits a forbidden token.

Checked on the tiny checkpoint's MTP layer: drafts that are always forbidden (a special token no
grammar admits) are all rejected, drafts that are the stream's own continuation are accepted, and
both runs give the same greedy streams, which validate; at temperature 1 with the MTP layer's own
drafts, every output validates over many seeds.
"""

from __future__ import annotations

import pytest

from glm53.tokenizer import GlmTokenizer
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.structured_outputs import StructuredOutputsParams
from serving.types import SamplingParams
from tests.serving.test_structured_outputs import (
    CHOICES,
    MAX_TOKENS,
    PERSON,
    PROMPT,
    REGEXES,
    assert_clean,
    check_output,
    json_params,
    run,
    text_of,
)


@pytest.fixture(scope="module")
def engine():
    e = build_engine(EngineArgs(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, cuda_graph_sizes=[],
                                precompile_token_paddings=[], compile_progress=False, disable_log_stats=True,
                                speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    yield e
    assert_clean(e)


@pytest.fixture(scope="module")
def tok(engine):
    return GlmTokenizer.from_pretrained(engine.model_path)


def constraints():
    out = {"person": (json_params(PERSON), "json", PERSON),
           "choice": (StructuredOutputsParams(choice=CHOICES), "choice", CHOICES)}
    for i, rx in enumerate(REGEXES):
        out[f"regex{i}"] = (StructuredOutputsParams(regex=rx), "regex", rx)
    return out


def test_forbidden_drafts_are_rejected_and_grammatical_drafts_accepted(engine, tok):
    e = engine
    prompt = tok.encode(PROMPT)
    reqs = {rid: (prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so))
            for rid, (so, _, _) in constraints().items()}
    forbidden = tok.token_to_id("[MASK]")  # a special token: no grammar here admits it
    s = e.spec_stats
    e.drafter_override = lambda req, n: [forbidden] * n
    before = (s.num_draft_tokens, s.num_accepted_tokens)
    try:
        rejected, reasons, _ = run(e, reqs)
    finally:
        e.drafter_override = None
    assert s.num_draft_tokens > before[0] and s.num_accepted_tokens == before[1]  # none accepted
    assert all(r == "stop" for r in reasons.values())
    for rid, (_, kind, spec) in constraints().items():
        assert forbidden not in rejected[rid]
        check_output(kind, spec, text_of(tok, e, rejected[rid]))
    # The streams' own continuations as drafts: accepted, and the same streams.
    e.drafter_override = lambda req, n: (rejected[req.request_id][req.num_output_tokens:] + [forbidden] * n)[:n]
    before = (s.num_draft_tokens, s.num_accepted_tokens)
    try:
        accepted, _, _ = run(e, reqs)
    finally:
        e.drafter_override = None
    assert accepted == rejected
    assert s.num_accepted_tokens - before[1] > 0.5 * (s.num_draft_tokens - before[0])


def test_sampled_outputs_with_the_mtp_drafts_validate(engine, tok):
    e = engine
    prompt = tok.encode(PROMPT)
    reqs, checks = {}, {}
    for seed in range(4):
        for rid, (so, kind, spec) in constraints().items():
            reqs[f"{rid}-{seed}"] = (prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                                                            structured_outputs=so))
            checks[f"{rid}-{seed}"] = (kind, spec)
    drafts = e.spec_stats.num_draft_tokens
    toks, reasons, _ = run(e, reqs)
    assert e.spec_stats.num_draft_tokens > drafts
    for rid, (kind, spec) in checks.items():
        assert reasons[rid] == "stop", (rid, reasons[rid])
        check_output(kind, spec, text_of(tok, e, toks[rid]))
