"""MTP speculative decoding (serving/spec_decode, glm53/mtp.py) on the shipped tiny checkpoint.

* Greedy streams with and without MTP agree under the equality rule (docs/design.md §10) for k = 1 and 3,
  on the bf16 and fp8 caches (prompts longer than index_topk = 64, chunked prefill, prefix caching).
* Test drafters: one proposing the known greedy continuation (every draft accepted, acceptance
  length k + 1) and one always wrong (every draft rejected): streams unchanged, counters and
  per-position counts consistent, block-pool audit clean after every step, and the rejected
  drafts' KV rolled back in every group: the MTP layer's drafts after many rejections equal the
  drafts computed from scratch over the accepted tokens (MTP group), and the streams equal the
  reference (MLA and indexer groups).
* The k + 1 verification rows' logits equal k + 1 single-token steps (fp32 tolerance).
* The verifier: greedy acceptance is the exact prefix match; the rejection rule keeps the target
  distribution (a chi-square test at a fixed seed).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm53 import api
from glm53.batch import single_sequence_batch
from glm53.equality import compare_streams
from glm53.kv_layout import build_kv_layout
from glm53.mtp import mtp_forward
from serving.engine import EngineArgs, LLMEngine
from serving.engine_factory import build_engine
from serving.spec_decode import DraftController, SpeculativeConfig, SpeculativeConfigError
from serving.spec_decode.rejection import verify_drafts
from serving.types import SamplingParams

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

PROMPTS = {"a": list(range(5, 25)), "b": [(7 * i) % 300 + 4 for i in range(90)],
           "c": [(13 * i) % 400 + 4 for i in range(150)]}
MAX_TOKENS = 16
VOCAB = 496  # the tiny tokenizer's ids (the checkpoint pads its vocabulary to 512)


@functools.lru_cache(maxsize=None)
def shared_engine(k: int | None, kv_cache_dtype: str = "bfloat16") -> LLMEngine:
    """One engine per (k, cache dtype) for the whole module (each costs a compile): the tests
    that share one leave it idle and clean (they assert the audit), and restore what they change."""
    return make_engine(k, kv_cache_dtype)


@functools.lru_cache(maxsize=None)
def plain_run(kv_cache_dtype: str):
    """The run without speculation on PROMPTS (greedy, top-2 logprobs), once per cache dtype."""
    return serve(shared_engine(None, kv_cache_dtype), logprobs=2)


@pytest.fixture(scope="module", autouse=True)
def _release_shared_engines():
    yield
    shared_engine.cache_clear()  # the engines' arenas are freed with the module
    plain_run.cache_clear()


def make_engine(k: int | None, kv_cache_dtype: str = "bfloat16", **kw) -> LLMEngine:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    args = EngineArgs(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, cuda_graph_sizes=[], precompile_token_paddings=[],
                      compile_progress=False, disable_log_stats=True, enable_prefix_caching=True,
                      kv_cache_dtype=kv_cache_dtype, speculative_config=spec, **kw)
    return build_engine(args)


def serve(engine: LLMEngine, prompts=PROMPTS, logprobs=None, check=None, max_tokens=None, sampling=None):
    """Run `prompts` to the end (greedy unless `sampling` gives other `SamplingParams` fields,
    ignore_eos, `max_tokens[rid]` or MAX_TOKENS tokens); audit after every step; `check(engine)` too."""
    for i, (rid, p) in enumerate(prompts.items()):
        sp = {"temperature": 0} if sampling is None else {**sampling, "seed": i}
        engine.add_request(rid, p, SamplingParams(max_tokens=(max_tokens or {}).get(rid, MAX_TOKENS),
                                                  ignore_eos=True, logprobs=logprobs, **sp))
    toks = {rid: [] for rid in prompts}
    lps = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.new_logprobs or []
        assert engine.audit() == [], engine.audit()
        if check is not None:
            check(engine)
    assert engine.pool.num_free == engine.pool.num_usable_blocks or engine.prefix_cache is not None
    return toks, lps


@pytest.mark.parametrize("dtype,k", [("bfloat16", 1), ("bfloat16", 3), ("fp8", 3)])
def test_greedy_streams_equal_with_and_without_mtp(dtype, k):
    """k = 1 and 3 on the bf16 cache, k = 3 on the fp8 cache (fp8 with k = 1 would add an engine
    and its compiles to the suite and no code path: the cache dtype and k meet nowhere but in the
    row counts k = 3 already exercises)."""
    ref, ref_lps = plain_run(dtype)
    lm = api.load(cache_dtype=dtype)
    e = shared_engine(k, dtype)
    before = e.spec_stats.num_drafts
    got, _ = serve(e)
    compare_streams(ref, got, ref_lps, PROMPTS, lm)
    s = e.spec_stats
    assert s.num_drafts > before and s.num_draft_tokens >= s.num_drafts  # drafts were really verified
    print(f"\n{dtype} k={k}: {s.num_accepted_tokens}/{s.num_draft_tokens} drafts accepted (random weights)")


@pytest.fixture(scope="module")
def k3_engine():
    return shared_engine(3)


@pytest.fixture(scope="module")
def plain_streams():
    return plain_run("bfloat16")


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_1_and_min_p_1_sample_the_greedy_stream(k3_engine, plain_streams, filters):
    """Temperature 1 with top_k = 1, or with min_p = 1, leaves only the most likely token: the
    sampled streams equal the greedy run's, through the plain engine's sampler and through MTP's
    verification (drafts accepted against the filtered target distribution, corrections and
    bonus tokens drawn from it). Without the filters these draws differ from greedy at once."""
    ref, ref_lps = plain_streams
    lm = api.load(cache_dtype="bfloat16")
    for e in (shared_engine(None, "bfloat16"), k3_engine):
        got, _ = serve(e, sampling={"temperature": 1.0, **filters})
        compare_streams(ref, got, ref_lps, PROMPTS, lm)
    unfiltered, _ = serve(shared_engine(None, "bfloat16"), sampling={"temperature": 1.0})
    assert unfiltered != ref  # the draws would differ without the filter


def test_min_tokens_holds_back_a_stop_id_through_the_verification_rows(k3_engine, plain_streams):
    """A stop token id the greedy stream reaches at position p, with min_tokens past p: every
    verification row before min_tokens masks it (drafts of it rejected, corrections drawn
    without it), so the stream takes the plain run's second choice at p and runs past it."""
    ref, ref_lps = plain_streams
    toks = ref["b"]
    p = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    stop = toks[p]
    e = k3_engine
    e.add_request("mt", PROMPTS["b"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                                                     min_tokens=p + 2))
    got = []
    while e.has_unfinished_requests():
        for o in e.step():
            got += o.new_token_ids
        assert e.audit() == []
    assert got[:p] == toks[:p] and got[p] == ref_lps["b"][p].top[1][0]
    assert len(got) >= p + 2 and stop not in got[: p + 2]


def test_prompt_logprobs_under_mtp_equal_the_non_speculative_engines(k3_engine, plain_streams):
    """Prompt logprobs (serving/prompt_logprobs.py) through the speculative step (its whole-step
    "+prompt-logprobs" variant: the rows index the target model's hidden states), a 150-token
    prompt prefilling beside a request whose drafts are verified: equal to the non-speculative
    engine's (its split forward pass; the same chunks, the bf16 cache: to 1e-4), and the greedy
    stream equal to the plain run's."""
    ref, _ = plain_streams
    got = {}
    for e in (shared_engine(None), k3_engine):
        e.add_request("a", PROMPTS["a"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        e.step()  # a prefills first: its drafts are verified while c prefills
        e.add_request("c", PROMPTS["c"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                        prompt_logprobs=3))
        toks, plp = [], None
        while e.has_unfinished_requests():
            for o in e.step():
                toks += o.new_token_ids if o.request_id == "c" else []
                plp = o.prompt_logprobs or plp
            assert e.audit() == []
        got[e.drafts is not None] = (toks, plp)
    assert k3_engine.spec_stats.num_drafts > 0 and got[True][0] == ref["c"]
    (_, plain), (_, spec) = got[False], got[True]
    assert len(spec) == len(PROMPTS["c"]) and spec[0] is None
    for a, b in zip(plain[1:], spec[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4 and a.rank == b.rank
        assert [i for i, _ in a.top] == [i for i, _ in b.top]


def _per_pos_consistent(s, k):
    pp = s.accepted_per_pos
    assert len(pp) == k and all(a >= b for a, b in zip(pp, pp[1:]))  # monotone
    assert sum(pp) == s.num_accepted_tokens


def test_oracle_drafter_accepts_every_draft(k3_engine, plain_streams):
    """Every draft accepted: the streams, and the logprobs of every emitted token (up to k + 1 per
    step, each from its own verification row), equal the plain run's."""
    ref, ref_lps = plain_streams
    e = k3_engine
    e.drafter_override = lambda req, n: (ref[req.request_id][req.num_output_tokens:] + [0] * n)[:n]
    before = (e.spec_stats.num_drafts, e.spec_stats.num_draft_tokens, e.spec_stats.num_accepted_tokens)
    steps0 = e.num_steps
    try:
        got, lps = serve(e, logprobs=2)
    finally:
        e.drafter_override = None
    assert got == ref
    for rid in ref:
        assert [x.token_id for x in lps[rid]] == ref[rid]
        np.testing.assert_allclose([x.logprob for x in lps[rid]], [x.logprob for x in ref_lps[rid]], atol=2e-3)
        np.testing.assert_allclose([[v for _, v in x.top] for x in lps[rid]],
                                   [[v for _, v in x.top] for x in ref_lps[rid]], atol=2e-3)
    s = e.spec_stats
    drafts, draft_tokens, accepted = (s.num_drafts - before[0], s.num_draft_tokens - before[1],
                                      s.num_accepted_tokens - before[2])
    assert accepted == draft_tokens > 0  # every draft accepted
    # Every decode step of a request with 3 drafts emits 4 tokens: 15 tokens after the first take
    # 4 verifications (3 + 3 + 3 + the last 2 drafts the max_tokens cap leaves room for... ) per request.
    assert drafts <= len(ref) * math.ceil((MAX_TOKENS - 1) / 4)
    assert e.num_steps - steps0 < 2 * MAX_TOKENS  # far fewer steps than one token per step
    _per_pos_consistent(s, 3)


def test_adaptive_drafting_and_disable_by_batch_size(k3_engine, plain_streams):
    """The engine follows its draft controller: no drafts while more than `disable_by_batch_size`
    requests run; with adaptive drafting and every draft rejected, 3 drafts per step at first,
    then 1 once the estimate of P(draft 1 accepted) falls below `adaptive_min_acceptance`."""
    ref, _ = plain_streams
    e = k3_engine
    saved = e.drafts
    scheds = []
    orig_schedule = e.scheduler.schedule

    def schedule():  # (requests running when the step is planned, drafts per sampling request)
        n = len(e.scheduler.running)
        out = orig_schedule()
        scheds.append((n, [sr.num_spec_tokens for sr in out.scheduled if sr.sample]))
        return out

    e.scheduler.schedule = schedule
    e.drafter_override = lambda req, n: [(t + 1) % VOCAB for t in
                                         (ref[req.request_id][req.num_output_tokens:] + [0] * n)[:n]]
    try:
        ctl = DraftController(SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2))
        e.drafts = e.scheduler.drafts = ctl
        got = serve(e, max_tokens={"a": 4})[0]  # "a" ends early: the others then run as a batch of 2
        assert got == {**ref, "a": ref["a"][:4]}
        assert any(n == 3 for n, _ in scheds)
        assert all(sum(spec) == 0 for n, spec in scheds if n > 2)
        assert any(sum(spec) > 0 for n, spec in scheds if n <= 2), scheds
        scheds.clear()
        ctl = DraftController(SpeculativeConfig(num_speculative_tokens=3, adaptive=True,
                                                adaptive_min_acceptance=0.5))
        e.drafts = e.scheduler.drafts = ctl
        assert serve(e, prompts={"b": PROMPTS["b"]})[0] == {"b": ref["b"]}
        verified = [spec[0] for _, spec in scheds if spec and spec[0]]
        assert verified[0] == 3 and verified[-1] == 1 and verified == sorted(verified, reverse=True)
    finally:
        e.drafts = e.scheduler.drafts = saved
        e.scheduler.schedule = orig_schedule
        e.drafter_override = None


def test_sampling_with_mtp_is_reproducible_per_seed(k3_engine, plain_streams):
    """temperature > 0 through the rejection sampler: a request's stream depends on its seed only
    (identical when run twice, alone or in another batch), and drafts are verified."""
    ref, _ = plain_streams
    e = k3_engine
    e.drafter_override = lambda req, n: (ref[req.request_id][req.num_output_tokens:] + [0] * n)[:n]

    def run(rids, seed):
        for rid in rids:
            e.add_request(rid + str(seed), PROMPTS[rid], SamplingParams(temperature=0.9, top_p=0.95, seed=seed,
                                                                        max_tokens=MAX_TOKENS, ignore_eos=True))
        out = {}
        while e.has_unfinished_requests():
            for o in e.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert e.audit() == []
        return out

    e.drafter_override = lambda req, n: (ref[req.request_id[0]][req.num_output_tokens:] + [0] * n)[:n]
    d0 = e.spec_stats.num_draft_tokens
    try:
        both = run(["b", "c"], 7)
        alone = run(["b"], 7)
        other = run(["b"], 8)
    finally:
        e.drafter_override = None
    assert len(both["b7"]) == MAX_TOKENS and both["b7"] == alone["b7"]
    assert other["b8"] != alone["b7"]
    assert e.spec_stats.num_draft_tokens > d0


PAD_LEN = 192


@pytest.fixture(scope="module")
def mtp_draft_from_scratch():
    """`fn(tokens) -> [(draft 1, top-2 gap), (draft 2, top-2 gap)]`: the MTP layer's first two drafts
    after `tokens` (its last token not yet computed), recomputed over a fresh cache for this one
    sequence: target hidden states of every position; MTP step 0 over positions 0 … L−2 (row i:
    token i+1 with hidden i), read at row L−2 → draft 1; step 1 at position L−1 with draft 1, step
    0's post-norm hidden and step 0's top-k (index_share_for_mtp_iteration) → draft 2. Argmax over
    the tokenizer's ids. One jitted program: the tokens are padded to PAD_LEN (causal: the padding
    does not reach row L−2)."""
    lm = api.load(cache_dtype="bfloat16")
    assert lm.config.index_share_for_mtp_iteration
    layout = build_kv_layout(lm.config, "bfloat16", with_mtp=True)
    graphdef, state = nnx.split(lm.model)
    pages = {g.name: list(range(1 + 8 * j, 1 + 8 * j + math.ceil(PAD_LEN / g.tokens_per_page)))
             for j, g in enumerate(layout.groups)}

    @jax.jit
    def logits_at(state, batch, mbatch, row):
        model = nnx.merge(graphdef, state)
        arena = layout.empty_arena(1 + 8 * len(layout.groups))
        hidden, arena = model.hidden_states(batch, arena, layout)
        h, arena, sel = mtp_forward(model, mbatch, hidden, arena, layout)
        l0 = model.logits(h[row][None])[0]
        d1 = jnp.argmax(l0[:VOCAB]).astype(jnp.int32)
        one = jax.tree.map(lambda x: x[:1], mbatch)  # one row: request 0, its block tables
        one = dataclasses.replace(one, input_ids_T=d1[None], positions_T=(row + 1)[None],
                                  slot_mapping={g: jnp.full((1,), -1, jnp.int32) for g in mbatch.slot_mapping},
                                  block_tables=mbatch.block_tables, logits_indices_B=jnp.zeros(1, jnp.int32))
        h1, _, _ = mtp_forward(model, one, h[row][None], arena, layout, prev_sel=(sel[0][row][None], None))
        return l0, model.logits(h1)[0]

    def fn(tokens):
        L = len(tokens)
        padded = list(tokens) + [0] * (PAD_LEN + 1 - L)
        batch = single_sequence_batch(layout, padded[:PAD_LEN], 0, pages)
        mbatch = jax.tree.map(jnp.asarray, single_sequence_batch(layout, padded[1:PAD_LEN + 1], 0, pages))
        out = []
        for lg in logits_at(state, batch, mbatch, jnp.int32(L - 2)):
            row = np.asarray(lg)[:VOCAB]
            top2 = np.sort(row)[-2:]
            out.append((int(np.argmax(row)), float(top2[1] - top2[0])))
        return out

    return fn


def test_wrong_drafter_rejects_every_draft_and_rolls_back(k3_engine, plain_streams, mtp_draft_from_scratch):
    ref, _ = plain_streams
    e = k3_engine
    e.drafter_override = lambda req, n: [(t + 1) % VOCAB for t in
                                         (ref[req.request_id][req.num_output_tokens:] + [0] * n)[:n]]
    before = (e.spec_stats.num_drafts, e.spec_stats.num_draft_tokens, e.spec_stats.num_accepted_tokens)
    seen = []

    def check(eng):
        for req in eng.scheduler.running:  # rejected drafts are not counted as computed
            if req.num_output_tokens:
                assert req.num_computed_tokens == req.num_tokens - 1
        for rid, d in eng.runner.last_drafts.items():
            req = eng.scheduler.get_request(rid)
            if req is not None and req.num_output_tokens >= 2 and rid in ("b", "c"):
                seen.append((rid, list(req.all_token_ids), d[:2]))

    try:
        got, _ = serve(e, check=check)
    finally:
        e.drafter_override = None
    assert got == ref
    s = e.spec_stats
    assert s.num_draft_tokens - before[1] > 0 and s.num_accepted_tokens == before[2]  # all rejected
    assert s.num_drafts - before[0] >= len(ref) * (MAX_TOKENS - 2)  # one verification per later token
    _per_pos_consistent(s, 3)
    # The MTP group after many rejected drafts (each wrote MTP KV at positions later recomputed):
    # the device's first two drafts equal the drafts recomputed from scratch over the accepted
    # tokens (draft 2 checks the recurrence: position, carried post-norm hidden, shared top-k).
    assert seen
    for rid, tokens, drafts in seen:
        (want1, gap1), (want2, gap2) = mtp_draft_from_scratch(tokens)
        if drafts[0] != want1:
            assert gap1 < 1e-3, (rid, len(tokens), drafts, want1, gap1)
            continue  # a near-tie flipped draft 1; draft 2 then follows another token
        assert drafts[1] == want2 or gap2 < 1e-3, (rid, len(tokens), drafts, want2, gap2)


def test_metrics_and_log_line_report_acceptance(k3_engine, plain_streams):
    from serving.metrics import LoggingStatLogger, PrometheusStatLogger

    ref, _ = plain_streams
    e = k3_engine
    prom = PrometheusStatLogger("tiny", e.gauges)
    log = LoggingStatLogger(e.gauges, interval_s=1e9)
    e.stat_loggers = [prom, log]
    e.drafter_override = lambda req, n: (ref[req.request_id][req.num_output_tokens:] + [0] * n)[:n]
    before = (e.spec_stats.num_drafts, e.spec_stats.num_draft_tokens, e.spec_stats.num_accepted_tokens,
              list(e.spec_stats.accepted_per_pos))
    try:
        serve(e, prompts={"a": PROMPTS["a"]})
    finally:
        e.drafter_override, e.stat_loggers = None, []
    s = e.spec_stats
    text = prom.render().decode()

    def value(name, extra=""):
        line = next(x for x in text.splitlines() if x.startswith(name + "{") and extra in x)
        return float(line.rsplit(" ", 1)[1])

    assert value("vllm:spec_decode_num_drafts_total") == s.num_drafts - before[0]
    assert value("vllm:spec_decode_num_draft_tokens_total") == s.num_draft_tokens - before[1]
    assert value("vllm:spec_decode_num_accepted_tokens_total") == s.num_accepted_tokens - before[2]
    for j in range(3):
        assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", f'position="{j}"') == \
            s.accepted_per_pos[j] - before[3][j]
    line = log.summary()
    assert "mean acceptance length" in line and "per-position acceptance" in line
    n, a = s.num_drafts - before[0], s.num_accepted_tokens - before[2]
    assert f"mean acceptance length {1 + a / n:.2f}" in line


def test_verification_rows_logits_equal_single_token_steps():
    """k + 1 = 4 rows of one request in one step vs 4 single-token steps, fp32."""
    lm = api.load()
    layout = lm.layout
    ids = [(11 * i) % 400 + 7 for i in range(80)]
    pages = {g.name: list(range(1 + 4 * j, 1 + 4 * j + math.ceil(len(ids) / g.tokens_per_page)))
             for j, g in enumerate(layout.groups)}
    split = len(ids) - 4
    a0 = layout.empty_arena(1 + 4 * len(layout.groups))
    _, _, a0 = api.forward_step(lm, single_sequence_batch(layout, ids[:split], 0, pages, logits_all=False), a0)
    a0 = np.asarray(a0)  # forward_step donates its arena: start both runs from this copy
    together, _, _ = api.forward_step(lm, single_sequence_batch(layout, ids[split:], split, pages), jnp.asarray(a0))
    arena, single = jnp.asarray(a0), []
    for p in range(split, len(ids)):
        lg, _, arena = api.forward_step(lm, single_sequence_batch(layout, [ids[p]], p, pages), arena)
        single.append(np.asarray(lg)[0])
    np.testing.assert_allclose(np.asarray(together), np.stack(single), atol=2e-4, rtol=0)


def test_greedy_verification_is_the_exact_prefix_match():
    rng = np.random.default_rng(0)
    B, k, V = 6, 3, 11
    logits = rng.normal(size=(B, k + 1, V)).astype(np.float32)
    am = logits.argmax(-1)
    drafts = am[:, :k].copy()
    drafts[1, 0] = (drafts[1, 0] + 1) % V  # rejected at 0
    drafts[2, 2] = (drafts[2, 2] + 1) % V  # rejected at 2
    drafts[3, 1] = (drafts[3, 1] + 1) % V  # rejected at 1 (and 2 would match again)
    num_draft = np.array([3, 3, 3, 3, 1, 0], np.int32)
    toks, acc = jax.jit(verify_drafts)(logits, drafts, num_draft, np.zeros(B, np.float32), np.ones(B, np.float32),
                                       np.zeros(B, np.int32), np.zeros(B, np.float32), np.zeros(B, np.uint32),
                                       np.zeros(B, np.int32))
    toks, acc = np.asarray(toks), np.asarray(acc)
    for b in range(B):
        a = 0
        while a < num_draft[b] and drafts[b, a] == am[b, a]:
            a += 1
        assert acc[b] == a
        assert list(toks[b, : a + 1]) == list(am[b, : a + 1])  # the plain greedy tokens


@pytest.mark.parametrize("top_p,top_k,min_p", [(0.9, 0, 0.0), (0.95, 4, 0.0), (1.0, -1, 0.3)])
def test_rejection_sampling_keeps_the_target_distribution(top_p, top_k, min_p):
    """Draws with a fixed draft token d: the first emitted token must follow p_0 (target at row 0)
    and, when d was accepted, the second must follow p_1. Temperature 0.8, vocabulary 8, the
    filters as given (numpy's own min-p / top-k / top-p below, in vLLM's order).
    Pearson chi-square against the expected counts; the test fails below p = 1e-4 (it passes at a
    fixed seed; a wrong rule — e.g. accepting d always, or drawing the correction from p_0 with d
    kept — gives p-values below 1e-30 at this sample size)."""
    def chisquare_pvalue(counts, expected):
        stat = float(((counts - expected) ** 2 / expected).sum())
        return float(jax.scipy.special.gammaincc((len(counts) - 1) / 2, stat / 2))

    V, N, t = 8, 40_000, 0.8
    rng = np.random.default_rng(1)
    l0, l1 = rng.normal(size=V).astype(np.float32), rng.normal(size=V).astype(np.float32)
    d = int(np.argsort(l0)[-2])  # the second most likely token: accepted sometimes, rejected often

    def nucleus(lg):
        z = np.exp(lg / t - (lg / t).max())
        p = z / z.sum()
        p = np.where(p >= min_p * p.max(), p, 0)  # min-p on the whole distribution
        order = np.argsort(-p, kind="stable")
        if top_k > 0:
            p[order[top_k:]] = 0
        p = p / p.sum()
        keep = np.zeros(V, bool)
        keep[order[(np.cumsum(p[order]) - p[order]) < top_p]] = True
        q = np.where(keep & (p > 0), p, 0)
        return q / q.sum()

    p0, p1 = nucleus(l0), nucleus(l1)
    logits = np.broadcast_to(np.stack([l0, l1])[None], (N, 2, V))
    toks, acc = jax.jit(verify_drafts)(logits, np.full((N, 1), d, np.int32), np.ones(N, np.int32),
                                       np.full(N, t, np.float32), np.full(N, top_p, np.float32),
                                       np.full(N, top_k, np.int32), np.full(N, min_p, np.float32),
                                       np.arange(N, dtype=np.uint32), np.zeros(N, np.int32))
    toks, acc = np.asarray(toks), np.asarray(acc)
    first = np.bincount(toks[:, 0], minlength=V)
    second = np.bincount(toks[acc == 1, 1], minlength=V)
    for counts, p in ((first, p0), (second, p1)):
        mask = p > 0
        assert counts[~mask].sum() == 0  # nothing outside the nucleus
        assert chisquare_pvalue(counts[mask], p[mask] * counts.sum()) > 1e-4
    assert abs(acc.mean() - p0[d]) < 5 * math.sqrt(p0[d] * (1 - p0[d]) / N)  # accepted w.p. p0(d)


@pytest.mark.parametrize("bad,key", [
    ({"method": "ngram", "num_speculative_tokens": 2}, "method"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 6}, "num_speculative_tokens"),
    ({"method": "mtp"}, "num_speculative_tokens is required"),
    ({}, "names no drafter"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "/ckpt"}, "draft `model`"),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ({"method": "mtp", "num_speculative_tokens": 2, "adaptive_min_acceptance": 0}, "adaptive_min_acceptance"),
    ({"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_speculative_config_names_the_key(bad, key):
    with pytest.raises(SpeculativeConfigError, match=key):
        SpeculativeConfig.from_dict(bad)


def test_draft_controller_rule():
    c = DraftController(SpeculativeConfig(num_speculative_tokens=4, adaptive=True, adaptive_min_acceptance=0.3,
                                          disable_by_batch_size=8))
    assert c.num_drafts(4) == 4 and c.num_drafts(9) == 0  # more than 8 running: no drafts
    for _ in range(60):  # position 1 accepted half the time, later ones never
        c.observe([(4, 1), (4, 0)])
    assert c.alpha[0] == pytest.approx(0.5, abs=0.02) and c.alpha[1] < 0.05
    assert c.num_drafts(1) == 1  # 0.5 ≥ 0.3 but 0.5 · α_2 < 0.3
    for _ in range(60):  # position 1 never accepted: still at least one draft (to keep measuring)
        c.observe([(1, 0)])
    assert c.num_drafts(1) == 1
    static = DraftController(SpeculativeConfig(num_speculative_tokens=3))
    static.observe([(3, 0)] * 10)
    assert static.num_drafts(100) == 3


HS_CONV = dict(conversations=3, turns=2, first_tokens=700, new_tokens=24, max_tokens=12)
HS_SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def record_drafts(drafts: dict):
    """An `on_step` hook recording each request's next drafts by (request id, its length then)."""
    def on_step(e, i):
        for rid, d in e.runner.last_drafts.items():
            req = e.scheduler.get_request(rid)
            if req is not None and d:
                drafts[(rid, req.num_tokens)] = tuple(d)
    return on_step


@pytest.fixture(scope="module")
def ample_mtp_run():
    """`HS_CONV` on an ample pool with MTP k = 3 (the real drafter), no HiSparse: the streams (the
    target's, as without speculation) and the drafts."""
    from tests.helpers.conversations import run_conversations
    from tests.serving.test_hisparse_engine import AMPLE
    from tests.serving.test_hisparse_engine import engine as hs_engine

    drafts = {}
    run = run_conversations(hs_engine(AMPLE, "bfloat16", speculative_config=HS_SPEC), logprobs=2,
                            on_step=record_drafts(drafts), **HS_CONV)
    return run, drafts


def test_hisparse_with_mtp_streams_equal_the_ample_run_and_the_drafts_read_host_rows(ample_mtp_run):
    """Hybrid HiSparse + MTP (k = 3, the reference deployment's pairing) under KV pressure, with the
    real drafter. Verification: each decode step verifies k + 1 rows per request, resolved
    through a hot buffer of (k + 2) × index_topk rows; the random-weight drafter's drafts are
    rejected and their KV rolled back (every draft accepted under HiSparse: the TP2 × DCP2 oracle
    test in tests/sharding/test_hisparse_parallel.py); nobody is preempted, and the streams equal the ample MTP
    engine's (equality rule). The MTP layer: its latent rows are one more layer of the `mla`
    group, copied to the host pool with their pages and released with them, and it resolves its
    top-k through the hot buffer (its own index group F = len(full_layers)); its drafts for a
    request at a given length are the ample engine's (it read the same rows: ≥ 95 % of the
    (request, length) draft lists equal, the rest allowed for near-ties of another batch
    composition), the MTP index group held host rows, clean host pages equal their device copies
    byte for byte (the MTP layer included), and nothing leaks."""
    from glm53.kv_layout import mtp_index_layer
    from tests.helpers.conversations import run_conversations
    from tests.helpers.hisparse_pool import check_host_pool_bytes
    from tests.serving.test_hisparse_engine import HISPARSE, SMALL
    from tests.serving.test_hisparse_engine import engine as hs_engine

    lm = api.load(cache_dtype="bfloat16")
    F = mtp_index_layer(lm.config)
    checked, mtp_hot = [0], [False]
    hs_drafts = {}
    record = record_drafts(hs_drafts)

    def on_step(e, i):
        record(e, i)
        mtp_hot[0] |= bool((np.asarray(e.hisparse.device.hot.host_row_SGM)[:, F, :] >= 0).any())
        if i % 8 == 7:  # clean host pages equal their device copies, every layer incl. the MTP one
            checked[0] += check_host_pool_bytes(e)

    ample, ref_drafts = ample_mtp_run
    e = hs_engine(SMALL, "bfloat16", HISPARSE, speculative_config=HS_SPEC)
    assert e.layout.group("mla").component("mla")[1].num_layers == lm.config.num_hidden_layers + 1
    assert e.hisparse.config.device_buffer_rows == 5 * lm.config.index_topk  # (k + 2) × index_topk
    hot_verify_steps = []
    orig_exec = e.runner.execute

    def execute(sched, kv):  # steps that verified drafts through the hot path
        n = e.runner.num_hot_steps
        out = orig_exec(sched, kv)
        if e.runner.num_hot_steps > n and sched.num_spec_tokens:
            hot_verify_steps.append(sched.num_spec_tokens)
        return out

    e.runner.execute = execute
    run = run_conversations(e, on_step=on_step, **HS_CONV)
    compare_streams(ample.outputs, run.outputs, ample.logprobs, ample.prompts, lm)
    common = ref_drafts.keys() & hs_drafts.keys()
    same = sum(ref_drafts[k] == hs_drafts[k] for k in common)
    d, s = e.hisparse.device, e.spec_stats
    print(f"\nhisparse+mtp: drafts equal {same}/{len(common)}; accepted {s.num_accepted_tokens}/{s.num_draft_tokens} "
          f"{s.accepted_per_pos}; {len(hot_verify_steps)} hot verify steps; hot hits {d.hits}, misses {d.misses}; "
          f"{checked[0]} clean host pages checked; pages released {e.hisparse.policy.num_released}")
    assert hot_verify_steps  # verification rows were resolved through the hot buffer
    assert s.num_accepted_tokens < s.num_draft_tokens  # rejected drafts, their KV rolled back
    assert len(common) > 20 and same >= 0.95 * len(common)
    assert mtp_hot[0] and d.misses > 0 and e.hisparse.policy.num_released > 0 and checked[0] > 0
    assert e.scheduler.num_preemptions_total == 0 and d.drops_outside_truncation == 0
    assert e.pool.num_free == e.pool.num_usable_blocks
    assert e.hisparse.host.blocks.num_free == e.hisparse.host.num_usable


def test_checkpoint_without_mtp_layer_is_refused_naming_the_flag(tmp_path):
    from tests.helpers.tiny_variant import tiny_checkpoint_with

    d = tiny_checkpoint_with(tmp_path / "no_mtp", num_nextn_predict_layers=0)
    args = EngineArgs(model=str(d), max_model_len=128, compile_progress=False, disable_log_stats=True,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="--speculative-config.*MTP layer"):
        build_engine(args)


def test_offloading_connector_with_mtp_brings_back_every_group():
    """The connector stores and loads the MTP layer's rows with their pages (one more layer of the
    `mla` and `indexer` groups): a prefix evicted from the device comes back from the host (its
    hit ends at the largest page of any group, the indexer group's), the warm run's
    tokens equal the cold run's (drafts included: the MTP rows came back too), and nothing leaks."""
    from tests.serving.test_hisparse_engine import SMALL
    from tests.serving.test_hisparse_engine import engine as hs_engine
    from tests.serving.test_offload import assert_clean, offload_flag, run_one

    e = hs_engine(SMALL, "bfloat16", kv_transfer_config=offload_flag(),
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    idx_tpp = e.kv.group("indexer").tokens_per_page
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 490, 900).tolist()
    assert {g.name for g in e.kv.groups} == {"mla", "indexer"} and idx_tpp < len(prompt)
    st = e.spec_stats
    a0 = (st.num_draft_tokens, st.num_accepted_tokens)
    cold = run_one(e, "cold", prompt)
    cold_spec = (st.num_draft_tokens - a0[0], st.num_accepted_tokens - a0[1])
    for i in range(3):  # other prompts take the device pages back
        run_one(e, f"evict{i}", rng.integers(10, 490, 900).tolist())
    loaded0 = e.offload.store.num_loaded
    a0 = (st.num_draft_tokens, st.num_accepted_tokens)
    warm = run_one(e, "warm", prompt)
    # The drafts read the loaded MTP rows: the same drafts accepted as in the cold run
    assert (st.num_draft_tokens - a0[0], st.num_accepted_tokens - a0[1]) == cold_spec
    hit = (len(prompt) - 1) // idx_tpp * idx_tpp  # whole indexer pages (the group with the largest page)
    assert warm[2] == hit and warm[3] == len(prompt) - hit  # the hit was loaded, not recomputed
    assert e.offload.store.num_loaded - loaded0 == hit // 64 + hit // idx_tpp  # its MLA + indexer pages
    assert warm[0] == cold[0] and e.spec_stats.num_draft_tokens > 0
    assert_clean(e)


def test_without_index_share_each_draft_step_runs_the_mtp_indexer(tmp_path, plain_streams):
    """`index_share_for_mtp_iteration: false`: draft steps ≥ 1 run the MTP layer's indexer and write
    their KV; the streams still equal the plain run's, and drafts are verified."""
    from tests.helpers.tiny_variant import tiny_checkpoint_with

    d = tiny_checkpoint_with(tmp_path / "no_index_share", index_share_for_mtp_iteration=False)
    e = make_engine(3, model=str(d))
    assert not e.config.index_share_for_mtp_iteration
    got, _ = serve(e)
    assert got == plain_streams[0]
    assert e.spec_stats.num_draft_tokens > 0
