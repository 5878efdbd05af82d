"""Data-parallel serving (`serving/dp_engine.py`): attention replicas with their own requests,
schedulers and pools, one jitted step for all, experts split over every device.

The shipped tiny checkpoint (4 heads, 8 experts) served by `LLMEngine.from_args` under DP2 + EP
(experts 4 per device) and DP4 × TP2 + EP8 (1 expert per device, heads split in each replica),
against the single-device engine's greedy streams for six concurrent requests of 20 … 100 tokens
(chunked prefill at 16 tokens per step, so prefill chunks and decodes mix; one step bucket per
engine keeps the compiles short). Equality rule as in
test_engine_parallel.py: identical streams, except a divergence at a near-tie (single-device
top-2 logit gap below 1e-4 at the first differing token).

Isolation (DP2, 5 pages per replica: 4 usable, so the six requests also preempt): one step's
writes land only in the pages of the replica serving the request; an abort on replica 0 and a
preemption on replica 1 (two 60-token requests on 4 pages, one growing past 64 tokens) leave the
other replica's requests serving the single-device streams.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from glm53 import api
from serving.dp_engine import DataParallelEngine
from serving.engine import EngineArgs, LLMEngine
from serving.engine_factory import build_engine
from serving.types import SamplingParams
from sharding.distributed import free_port_pair
from sharding.mesh import ParallelConfig
from tests.helpers.drafts import record_drafts
from tests.helpers.kv_event_view import Subscriber
from tests.helpers.penalties_oracle import check_greedy_stream
from tests.helpers.prompt_logprobs_oracle import check_prompt_logprobs

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

PROMPTS = {"a": list(range(5, 25)), "b": [(7 * i) % 300 + 4 for i in range(70)],
           "c": [(13 * i) % 400 + 4 for i in range(100)], "d": [(11 * i) % 350 + 4 for i in range(40)],
           "e": [(17 * i) % 450 + 4 for i in range(60)], "f": [(19 * i) % 420 + 4 for i in range(60)]}
MAX_TOKENS = 6
EPS = 1e-4
DP2_EP = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)


def params(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


LOGPROBS = {"d": 3}  # d (replica 1 of DP2, 3 of DP4) also returns its top-3 logprobs (fp32: 1e-4)


def build(parallel: ParallelConfig | None, num_blocks: int, **kw) -> LLMEngine:
    args = dict(dtype="float32", max_model_len=192, max_num_seqs=4, max_num_batched_tokens=16,
                num_gpu_blocks_override=num_blocks, compile_progress=False, parallel=parallel,
                cuda_graph_sizes=[], precompile_token_paddings=[])
    return build_engine(EngineArgs(**{**args, **kw}))


def drain(engine: LLMEngine, streams: dict[str, list[int]], logprobs: dict | None = None,
          audit_each_step: bool = False) -> dict[str, list[int]]:
    while engine.has_unfinished_requests():
        outs = engine.step()
        if audit_each_step:
            assert engine.audit() == []
        for out in outs:
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
            if logprobs is not None and out.new_logprobs:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
    return streams


def check_streams(got: dict[str, list[int]], ref: dict[str, list[int]], ids) -> None:
    lm = None
    for rid in ids:
        assert len(got[rid]) == len(ref[rid]) == MAX_TOKENS, rid
        if got[rid] == ref[rid]:
            continue
        i = next(j for j, (a, b) in enumerate(zip(got[rid], ref[rid])) if a != b)
        lm = lm or api.load()
        row = api.forward(lm, PROMPTS[rid] + ref[rid][:i])[-1]
        top2 = np.sort(row)[-2:]
        print(f"\n{rid}: diverges at token {i} ({got[rid][i]} vs {ref[rid][i]}), top-2 gap {top2[1] - top2[0]:.2e}")
        assert top2[1] - top2[0] < EPS


@pytest.fixture(scope="module")
def single_device():
    return build(None, 24)


@pytest.fixture(scope="module")
def reference(single_device):
    for rid, p in PROMPTS.items():
        single_device.add_request(rid, p, params(LOGPROBS.get(rid)))
    lps: dict = {}
    streams = drain(single_device, {}, lps)
    streams["logprobs"] = lps
    return streams


@pytest.fixture(scope="module")
def dp2():
    engine = build(DP2_EP, 5)
    assert isinstance(engine, DataParallelEngine) and len(engine.replicas) == 2
    assert engine.runner.kv_arena.shape[0] == 2 * 5  # one 5-page shard per replica
    return engine


def serve_all(engine: DataParallelEngine, reference_logprobs: dict, audit_each_step: bool = False
              ) -> tuple[dict, list[int]]:
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, params(LOGPROBS.get(rid)))
    placed = [engine.replica_of(rid).index for rid in PROMPTS]
    lps: dict = {}
    streams = drain(engine, {}, lps, audit_each_step)
    for rid, ref in reference_logprobs.items():  # sampled rows come back from the replica's own slice
        got = lps[rid]
        assert [x.token_id for x in got] == [x.token_id for x in ref]
        assert [[t for t, _ in x.top] for x in got] == [[t for t, _ in x.top] for x in ref]
        np.testing.assert_allclose([x.logprob for x in got], [x.logprob for x in ref], atol=1e-4)
    assert engine.audit() == []
    for rep in engine.replicas:
        assert rep.scheduler.audit() == [] and rep.pool.usage() == 0.0
    return streams, placed


def test_dp2_ep_streams_equal_single_device(dp2, reference):
    streams, placed = serve_all(dp2, reference["logprobs"])
    assert placed == [0, 1, 0, 1, 0, 1]  # least loaded: fewest unfinished requests, then lowest index
    check_streams(streams, reference, PROMPTS)
    # Asynchronous scheduling (serving/async_scheduling.py) on the same engine: every replica's
    # placeholder rows are fed from its own slice of the stacked step; same streams and logprobs,
    # audits clean after every step.
    assert dp2.async_scheduling is False  # EngineArgs' default
    dp2.set_async_scheduling(True)
    try:
        async_streams, async_placed = serve_all(dp2, reference["logprobs"], audit_each_step=True)
        # An abort on replica 0 while a step that samples for it is in flight: its placeholder
        # token is dropped, nothing leaks, replica 1 serves on.
        for rid in "ab":
            dp2.add_request(rid, PROMPTS[rid], params())
        got = {}
        while not got.get("a"):
            for out in dp2.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert dp2._in_flight is not None and dp2.abort("a") is not None
        drain(dp2, got, audit_each_step=True)
        assert got["b"] == reference["b"] and got["a"] == reference["a"][:len(got["a"])] and len(got["a"]) < MAX_TOKENS
        assert all(r.pool.usage() == 0.0 for r in dp2.replicas)
    finally:
        dp2.set_async_scheduling(False)
    assert async_placed == placed and async_streams == streams


def test_dp4_tp2_ep8_streams_equal_single_device(reference):
    cfg = ParallelConfig(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True)
    engine = build(cfg, 5)
    streams, placed = serve_all(engine, reference["logprobs"])
    assert placed == [0, 1, 2, 3, 0, 1]
    check_streams(streams, reference, PROMPTS)


def test_dp2_isolation_abort_and_preemption(dp2, reference):
    engine, nb = dp2, 5
    preempted = [r.scheduler.num_preemptions_total for r in engine.replicas]
    engine.add_request("d", PROMPTS["d"], params())  # replica 0 served a and c: its pages change
    assert engine.replica_of("d").index == 0
    before = np.asarray(engine.runner.kv_arena)
    streams = {}
    for out in engine.step():
        streams.setdefault(out.request_id, []).extend(out.new_token_ids)
    after = np.asarray(engine.runner.kv_arena)
    changed = set(np.flatnonzero((before != after).any(axis=1)).tolist())
    kv0 = engine.replicas[0].kv
    pages_d = {b for g in ("mla", "indexer") for b in kv0.block_table("d", g)}
    assert changed == pages_d  # rows 0 .. nb-1 are replica 0's shard: nothing else was written
    assert all(r < nb for r in changed)

    # e: replica 1 (fewer unfinished); f: tie on requests, replica 1 uses fewer pages. e and f hold
    # 2 pages each of replica 1's 4; e's decode at position 64 needs a 5th: f is preempted.
    engine.add_request("e", PROMPTS["e"], params())
    engine.add_request("f", PROMPTS["f"], params())
    assert [engine.replica_of(r).index for r in "ef"] == [1, 1]
    with pytest.raises(ValueError, match="duplicate"):  # e lives on replica 1; replica 0 is the least loaded
        engine.add_request("e", PROMPTS["e"], params())
    g = engine.gauges  # sums over replicas; usage = mean: replica 0 holds 2 of its 4 usable pages
    assert (g.num_requests_running(), g.num_requests_waiting(), g.kv_cache_usage()) == (1, 2, 0.25)
    for _ in range(2):
        for out in engine.step():
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
    aborted = engine.abort("d")
    assert aborted is not None and aborted.finished and engine.replicas[0].pool.usage() == 0.0
    assert engine.audit() == []
    drain(engine, streams)
    assert engine.replicas[0].scheduler.num_preemptions_total == preempted[0]
    assert engine.replicas[1].scheduler.num_preemptions_total > preempted[1]
    assert engine.audit() == [] and all(r.pool.usage() == 0.0 for r in engine.replicas)
    assert 0 < len(streams["d"]) < MAX_TOKENS and streams["d"] == reference["d"][:len(streams["d"])]
    check_streams(streams, reference, "ef")


def test_dp2_requests_sent_one_at_a_time_alternate_over_the_replicas(dp2):
    """An idle engine ties on load and pages (finished requests' pages are free): the tie goes to the
    replica placed the fewest requests (then the lower index), so one-at-a-time traffic uses both
    replicas' caches: the placement counts even out whatever the module's earlier tests left."""
    start = list(dp2.placements.placed)
    for i in range(4):
        before = list(dp2.placements.placed)
        dp2.add_request(f"serial{i}", PROMPTS["a"][: 10 + i], params())
        assert dp2.replica_of(f"serial{i}").index == min(range(2), key=lambda r: (before[r], r)), before
        drain(dp2, {})
    p0, p1 = dp2.placements.placed
    assert abs(p0 - p1) <= max(1, abs(start[0] - start[1]) - 4)
    assert dp2.audit() == []


def test_dp2_penalties_of_each_replica_follow_the_oracle(dp2):
    """Penalties and logit biases on both replicas of one stacked step (their sparse lists stacked
    replica-major like the request rows, `serving.penalties.step_penalties`): each greedy stream
    against the dense NumPy oracle (tests/helpers/penalties_oracle.py)."""
    adjust = {"a": {"repetition_penalty": 0.5, "logit_bias": {42: 1.5}},
              "d": {"frequency_penalty": -1.5, "presence_penalty": 0.3}}
    for rid, adj in adjust.items():
        dp2.add_request(f"{rid}_pen", PROMPTS[rid], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True, **adj))
    assert sorted(dp2.replica_of(f"{r}_pen").index for r in adjust) == [0, 1]  # one on each
    streams = drain(dp2, {}, audit_each_step=True)
    lm = api.load()
    for rid, adj in adjust.items():
        assert len(streams[f"{rid}_pen"]) == MAX_TOKENS
        check_greedy_stream(lm, PROMPTS[rid], streams[f"{rid}_pen"], adj, dp2.runner.sampling_vocab_size)
    assert dp2.audit() == [] and all(r.pool.usage() == 0.0 for r in dp2.replicas)


def test_dp2_prompt_logprobs_of_each_replica_follow_one_full_forward(dp2):
    """Prompt logprobs (serving/prompt_logprobs.py) of a request on each replica of one stacked step
    (rows indexed into replica r's slice of the hidden states) against one full forward
    (tests/helpers/prompt_logprobs_oracle.py)."""
    for rid in ("c", "e"):
        dp2.add_request(f"{rid}_plp", PROMPTS[rid], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    assert sorted(dp2.replica_of(f"{r}_plp").index for r in ("c", "e")) == [0, 1]  # one on each
    got = {}
    while dp2.has_unfinished_requests():
        for o in dp2.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
    lm = api.load()
    for rid in ("c", "e"):
        check_prompt_logprobs(lm, PROMPTS[rid], got[f"{rid}_plp"], 2, dp2.runner.sampling_vocab_size)
    assert dp2.audit() == [] and all(r.pool.usage() == 0.0 for r in dp2.replicas)


def test_dp2_tp2_dcp2_prefix_hit_copies_in_its_replica_shards(single_device, reference):
    """DP2 × TP2 with DCP2 over TP (engine pages of 128 / 1536 tokens, hash unit 128) and prefix
    caching: a request sharing 128 tokens with a running request on the same replica hits them;
    the hit ends inside the running request's indexer page, so that page is copied on the device
    (in the replica's own two DCP shards) before the step. The new request's stream equals the
    single-device one; the other replica's cache is not queried."""
    cfg = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, decode_context_parallel_size=2,
                         enable_expert_parallel=True)
    port = free_port_pair()
    engine = build(cfg, 8, max_model_len=384, enable_prefix_caching=True,
                   kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    subs = [Subscriber(f"tcp://127.0.0.1:{port + r}") for r in range(2)]  # replica r: port + r
    time.sleep(0.3)  # the subscriptions reach the publishers before the first step
    assert engine.runner.kv_arena.shape[0] == 2 * 2 * 8 and engine.prefix_cache.unit == 128
    rng = np.random.default_rng(3)
    stem, filler = rng.integers(4, 450, 200).tolist(), rng.integers(4, 450, 300).tolist()
    long_params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("stem", stem, long_params)  # replica 0: 2 MLA pages + 1 indexer page
    engine.add_request("filler", filler, long_params)  # replica 1: 3 MLA pages + 1 indexer page
    rep0, rep1 = engine.replicas
    while rep0.scheduler.get_request("stem").num_output_tokens == 0:
        engine.step()
    warm = stem[:128] + [7] * 8
    copies, queries1 = engine.runner.num_page_copies, rep1.prefix_cache.queries
    engine.add_request("warm", warm, params())
    assert engine.replica_of("warm") is rep0  # tie on requests; replica 0 uses fewer pages
    got = {}
    while engine.replica_of("warm") is not None:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.runner.num_page_copies - copies == 1 and rep0.prefix_cache.hits == 128
    # The placement counters: three requests, the warm one placed for its 128-token hit.
    assert engine.placements.placed == [2, 1] and engine.placements.prefix_hit_tokens == 128
    from serving.metrics import PrometheusStatLogger

    text = PrometheusStatLogger("m", engine.gauges).render().decode()
    assert 'vllm:dp_placements_total{data_parallel_rank="0",model_name="m"} 2.0' in text
    assert 'vllm:dp_placement_prefix_hit_tokens_total{model_name="m"} 128.0' in text
    assert 'vllm:kv_events_published_total{model_name="m"}' in text
    assert rep1.prefix_cache.queries == queries1
    # KV events, one stream per replica: each tells the units its own prefix cache holds (block
    # size = the 128-token hash unit), tagged with its data-parallel rank.
    for sub in subs:
        sub.receive()
    assert [sub.ranks for sub in subs] == [{0}, {1}]
    for r, (sub, p) in enumerate(zip(subs, (stem, filler))):
        assert sub.view.block_size == 128 and sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
        assert sub.view.hit_tokens(p + [1]) == len(p) // 128 * 128 > 0
        assert sub.view.hit_tokens((filler, stem)[r] + [1]) == 0
    # What a router discovers (GET /kv_event_sources, /get_server_info): the sockets the
    # subscribers above heard, by rank, and the 128-token block size.
    sources = engine.kv_events.discovery_sources()
    assert {r: e["endpoint"] for r, e in sources.items()} == {"0": f"tcp://*:{port}", "1": f"tcp://*:{port + 1}"}
    assert engine.kv_events.block_size == 128
    for rid in ("stem", "filler"):
        engine.abort(rid)
    assert engine.audit() == []
    engine.kv_events.close()
    for sub in subs:
        sub.close()
    single_device.add_request("warm", warm, params())
    ref = drain(single_device, {})
    assert got["warm"] == ref["warm"]


MTP2 = {"method": "mtp", "num_speculative_tokens": 2}


def _spec_run(engine: LLMEngine, adjust: dict, drafter=None) -> tuple[dict, dict, set[int]]:
    """PROMPTS (request `f` with the penalties `adjust`) to the end on an MTP engine, auditing after
    every step → (streams, each request's drafts as `(tokens out, drafts)` per step, the step
    buckets used). `drafter(request, n)`: the drafts verified next (None: the MTP layer's own)."""
    drafts = record_drafts(engine, drafter)
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  logprobs=LOGPROBS.get(rid), **(adjust if rid == "f" else {})))
    streams: dict[str, list[int]] = {}
    lps: dict = {}
    buckets = set()
    try:
        while engine.has_unfinished_requests():
            outs = engine.step()
            buckets.add(engine.runner.last.padded_tokens // (engine.runner.dp or 1))
            assert engine.audit() == []
            for out in outs:
                streams.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.new_logprobs:
                    lps.setdefault(out.request_id, []).extend(out.new_logprobs)
    finally:
        engine.drafter_override = None
    streams["logprobs"] = lps
    return streams, drafts, buckets


def test_dp2_mtp_speculation_verifies_and_drafts_in_each_replica(reference):
    """MTP speculation (k = 2) under DP2 + EP: each replica's verification rows, drafts and MTP
    draft steps sit in its own slice of the stacked step (`serving.spec_decode.inputs.
    stack_spec_batches`; `spec_decode_forward` keeps every replica's first rows when the bucket
    has fewer token rows than request rows). Against independent results:
    * the MTP layer's own drafts (random weights: mostly rejected): every replica's requests give
      the single-device streams without speculation (the equality rule), request `d`'s logprobs
      too (1e-4), and the drafts each request but `f` carries after each step equal those of the
      single-device engine under the same speculation (without penalties), step for step;
    * an oracle drafter (the single-device continuation): every draft is accepted, same streams;
    * request `f` (replica 1: its rows follow replica 0's) carries penalties: its stream follows the dense NumPy oracle (its
      sparse entries are moved with its verification rows);
    * a 4-token bucket (fewer token rows than the 5 request rows of a replica) is among the steps;
      audits clean after every step, every pool empty at the end."""
    adjust = {"repetition_penalty": 0.5, "presence_penalty": 0.3}
    # (The single-device engine: one bucket, no penalties, for the drafts of every other request.)
    _, one_drafts, _ = _spec_run(build(None, 24, speculative_config=MTP2), {})
    engine = build(DP2_EP, 12, speculative_config=MTP2, precompile_token_paddings=[4])
    assert isinstance(engine, DataParallelEngine) and engine.runner.spec_k == 2
    streams, drafts, buckets = _spec_run(engine, adjust)
    assert [engine.replica_of(rid) for rid in PROMPTS] == [None] * len(PROMPTS)
    assert engine.placements.placed == [3, 3]  # a, c, e on replica 0; b, d, f on replica 1
    assert 4 in buckets
    others = [rid for rid in PROMPTS if rid != "f"]
    check_streams(streams, reference, others)
    for rid, ref in reference["logprobs"].items():
        got = streams["logprobs"][rid]
        assert [x.token_id for x in got] == [x.token_id for x in ref]
        np.testing.assert_allclose([x.logprob for x in got], [x.logprob for x in ref], atol=1e-4)
    check_greedy_stream(api.load(), PROMPTS["f"], streams["f"], adjust, engine.runner.sampling_vocab_size)
    assert streams["f"] != reference["f"]  # the penalties change f's stream
    drafts.pop("f")
    one_drafts.pop("f")
    assert drafts == one_drafts and sum(len(d) for d in drafts.values()) > 2 * len(others)
    s = engine.spec_stats
    assert s.num_draft_tokens > 0
    before = (s.num_draft_tokens, s.num_accepted_tokens)
    ref = {**reference, "f": streams["f"]}
    oracle = lambda req, n: (ref[req.request_id][req.num_output_tokens:] + [0] * n)[:n]
    streams, _, _ = _spec_run(engine, adjust, oracle)
    check_streams(streams, reference, others)
    assert streams["f"] == ref["f"]
    assert s.num_draft_tokens > before[0] and s.num_accepted_tokens - before[1] == s.num_draft_tokens - before[0]
    assert all(r.pool.usage() == 0.0 for r in engine.replicas)
    # The start-up compile (which servers run; the suite skips it) builds the stacked padding step.
    engine.runner.compile(progress=False)
    assert set(engine.runner.compile_seconds) == set(engine.runner.buckets) == {4, 16}


def test_dp2_mtp_without_index_share_drafts_as_one_device(reference, tmp_path):
    """`index_share_for_mtp_iteration: false` under DP2 + EP: MTP draft steps ≥ 1 run the MTP
    layer's indexer and write their KV rows through each replica's own block-table rows
    (`glm53.mtp.propose_drafts`: `req_idx` local to the replica, slots from the global table row).
    Every request's drafts after every step equal the single-device engine's with the same
    checkpoint, and the streams equal the single-device run without speculation."""
    from tests.helpers.tiny_variant import tiny_checkpoint_with

    d = tiny_checkpoint_with(tmp_path / "no_index_share", index_share_for_mtp_iteration=False)
    _, one_drafts, _ = _spec_run(build(None, 24, speculative_config=MTP2, model=str(d)), {})
    engine = build(DP2_EP, 12, speculative_config=MTP2, model=str(d))
    assert not engine.config.index_share_for_mtp_iteration
    streams, drafts, _ = _spec_run(engine, {})
    assert engine.placements.placed == [3, 3]
    check_streams(streams, reference, list(PROMPTS))
    assert drafts == one_drafts and engine.spec_stats.num_draft_tokens > 0
    assert all(r.pool.usage() == 0.0 for r in engine.replicas)


def test_cli_accepts_data_parallel():
    from serving.cli_args import make_arg_parser, validate_args

    args = make_arg_parser().parse_args(["--data-parallel-size", "8", "--enable-expert-parallel"])
    validate_args(args)
    assert args.parallel == ParallelConfig(data_parallel_size=8, enable_expert_parallel=True)
    # the reference's disaggregated decode engine: DP8 + EP8 with MTP3
    args = make_arg_parser().parse_args(["-dp", "8", "--enable-expert-parallel", "--speculative-config",
                                         '{"method": "mtp", "num_speculative_tokens": 3}'])
    validate_args(args)
    assert args.parallel.data_parallel_size == 8 and args.speculative_config["num_speculative_tokens"] == 3


def test_llmengine_from_args_refuses_a_data_parallel_layout_naming_the_factory():
    """`serving.engine_factory.build_engine` is the one place that picks DataParallelEngine; the
    base class asked to build a DP layout says so before loading anything."""
    with pytest.raises(ValueError, match="build_engine"):
        LLMEngine.from_args(EngineArgs(parallel=DP2_EP, compile_progress=False))


@pytest.mark.parametrize("with_hisparse", [False, True], ids=["offload", "hisparse+offload"])
def test_dp2_offloading_connector_gives_each_replica_its_own_host_store(with_hisparse):
    """DP2 + EP with prefix caching and the CPU offloading connector (one host store per replica,
    `cpu_bytes_to_use` each; one host page array, each replica's blocks in its own shards): two
    prompts cold on the two replicas at once, others then take both replicas' device pages back,
    and the two prompts again at once come back from their own replica's host store — every whole
    indexer page of each (the hit the connector can give: only full pages are stored) loaded, not
    recomputed, in one load program with a different list per replica — with the cold run's tokens
    and logprobs. Placement follows the host tier: unpinned, the second run of each prompt goes to
    the replica whose store holds it. Every pool and store audit is clean, and no replica's store
    holds the other's prompt.

    With Hybrid HiSparse as well (the reference's decode configuration: its host pool per replica
    for the MLA rows, the connector for the indexer keys): the MLA pages of the hit come back as
    HiSparse host pages, the indexer pages from the connector, with the same tokens and logprobs."""
    from tests.serving.test_offload import offload_flag

    hs = {"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 256}} if with_hisparse else None
    engine = build(DP2_EP, 24, max_model_len=1024, max_num_batched_tokens=128, enable_prefix_caching=True,
                   kv_transfer_config=offload_flag(2**24), attention_config=hs)
    assert (engine.hisparse is not None) == with_hisparse
    stores = engine.offload.stores
    assert len(stores) == 2 and stores[0] is not stores[1] and engine.runner.offload is engine.offload
    idx = engine.replicas[0].kv.group("indexer").tokens_per_page
    rng = np.random.default_rng(5)
    prompts = {"a": rng.integers(4, 450, 1000).tolist(), "b": rng.integers(4, 450, 950).tolist()}
    sp = lambda rank=None: SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2,
                                          data_parallel_rank=rank)

    def run(reqs: dict[str, tuple[list[int], int | None]]):
        computed: dict[str, int] = {}  # prompt rows scheduled
        first: dict[str, int] = {}  # the first prompt position scheduled
        origs = [rep.scheduler.schedule for rep in engine.replicas]

        def counting(orig):
            def schedule():
                out = orig()
                for sr in out.scheduled:
                    if sr.start_pos < len(sr.request.prompt_token_ids):
                        computed[sr.request_id] = computed.get(sr.request_id, 0) + sr.num_new_tokens
                        first[sr.request_id] = min(first.get(sr.request_id, sr.start_pos), sr.start_pos)
                return out
            return schedule

        for rep, orig in zip(engine.replicas, origs):
            rep.scheduler.schedule = counting(orig)
        try:
            for rid, (p, rank) in reqs.items():
                engine.add_request(rid, p, sp(rank))
            placed = {rid: engine.replica_of(rid).index for rid in reqs}
            toks: dict = {}
            lps: dict = {}
            cached: dict = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    toks.setdefault(o.request_id, []).extend(o.new_token_ids)
                    lps.setdefault(o.request_id, []).extend(o.new_logprobs or [])
                    cached[o.request_id] = o.num_cached_tokens
                assert engine.audit() == []
        finally:
            for rep, orig in zip(engine.replicas, origs):
                rep.scheduler.schedule = orig
        return toks, lps, cached, computed, placed, first

    cold = run({"a": (prompts["a"], 0), "b": (prompts["b"], 1)})
    assert cold[4] == {"a": 0, "b": 1} and cold[2] == {"a": 0, "b": 0}
    assert all(s.num_stored > 0 for s in stores)
    def lost(r: int, key: str) -> bool:
        """Replica r's device holds none of the prompt's pages: its hit is whole indexer pages, all
        from the host (the connector's store, and with HiSparse its host pool for the MLA rows)."""
        hit = engine.replicas[r].prefix_cache.lookup(_probe(prompts[key]))
        return hit.num_local_tokens == 0 and hit.num_tokens == (len(prompts[key]) - 1) // idx * idx > 0

    for i in range(6):  # other prompts take both replicas' device pages back (HiSparse keeps more: its
        # MLA pages go to its host pool, so the indexer pages stay longer)
        run({f"x{i}": (rng.integers(4, 450, 900).tolist(), 0), f"y{i}": (rng.integers(4, 450, 900).tolist(), 1)})
        if lost(0, "a") and lost(1, "b"):
            break
    loaded = [s.num_loaded for s in stores]
    for r, (own, other) in enumerate((("a", "b"), ("b", "a"))):
        pc = engine.replicas[r].prefix_cache
        assert lost(r, own)
        assert pc.lookup(_probe(prompts[other])).num_tokens == 0  # the other replica's prompt: nowhere here
    warm = run({"a2": (prompts["a"], None), "b2": (prompts["b"], None)})
    assert warm[4] == {"a2": 0, "b2": 1}, "placed away from the replica whose host store holds the prompt"
    for rid, p in (("a", prompts["a"]), ("b", prompts["b"])):
        hit = (len(p) - 1) // idx * idx
        assert hit > 0 and warm[2][rid + "2"] == hit
        assert warm[5][rid + "2"] == hit, "the host-tier hit was recomputed"
        if not with_hisparse:  # (HiSparse may compute a cut prefill chunk's rows again)
            assert warm[3][rid + "2"] == len(p) - hit
        assert warm[0][rid + "2"] == cold[0][rid]
        np.testing.assert_allclose([x.logprob for x in warm[1][rid + "2"]], [x.logprob for x in cold[1][rid]],
                                   rtol=0, atol=1e-4)
    tpp = engine.replicas[0].kv.group("mla").tokens_per_page
    for r, p in enumerate((prompts["a"], prompts["b"])):
        hit = (len(p) - 1) // idx * idx
        mla_pages = 0 if with_hisparse else hit // tpp  # HiSparse: the MLA rows come from its host pool
        assert stores[r].num_loaded - loaded[r] == mla_pages + hit // idx  # (MLA pages +) indexer pages
    if with_hisparse:
        assert all(pc.host_hits > 0 for pc in engine.hisparse.prefix_caches)
        for pol in engine.hisparse.policies:
            assert pol.host.blocks.num_free == pol.host.num_usable
    assert engine.prefix_cache is engine.replicas[0].prefix_cache
    assert sum(r.prefix_cache.external_hits for r in engine.replicas) >= warm[2]["a2"] + warm[2]["b2"]
    engine.step()  # idle: queued stores are flushed
    assert engine.audit() == []
    for s in stores:
        assert not s.queue and not s.in_flight and not s.pinned and s.blocks.num_free == s.num_usable
    for rep in engine.replicas:
        assert rep.pool.num_free == rep.pool.num_usable_blocks


def _probe(prompt: list[int]):
    from serving.request import Request

    return Request("probe", list(prompt) + [1], SamplingParams(max_tokens=1))
