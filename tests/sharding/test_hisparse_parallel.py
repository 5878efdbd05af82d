"""Hybrid HiSparse on every parallel layout (8 simulated CPU devices, the shipped tiny checkpoint).

A multi-turn workload (3 conversations × 2 turns, first turn 400 tokens = 6 × index_topk — 900
under DCP2 —, 24 new user tokens and 8 output tokens per turn) on a device pool far too small for it
(`SMALL`), served with
HiSparse under DP2 × TP2 + EP (a host pool, policy and hot state per replica; one host copy per
replica, the pool's columns split over its TP ranks), TP2 × DCP2, PCP2 × DCP2 and DP2 × TP2 × DCP2
(each DCP rank's host pool holds its token share of every page; each rank resolves the merged
top-k for the positions it owns). Every run is checked against the single-device run on an
ample pool without HiSparse (docs/design.md §10's equality rule, `glm53.equality`), with nobody
preempted, rows really read from the host, audits clean after every step, and — every few steps
— every clean host block of every replica and DCP rank equal, byte for byte, to the device page
it copies. Both host-gather mechanisms run ("callback" under TP2 × DCP2 and DP2 × TP2 × DCP2,
"memory_kind" elsewhere).

Also: an abort and a preemption in one replica leave the other replica's streams unchanged, and
under TP2 × DCP2 and DP2 × TP2 + EP the engines run MTP speculation (k = 2, every draft accepted)
and still serve the single-device non-speculative streams. Under PCP2 × DCP2
and DP2 × TP2 × DCP2 the prefill lease holds only two query rows' worst case, so prefill chunks are
sized adaptively and some are truncated at their first dropped selection (serving/hisparse/
truncation.py); the streams are held to the same rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm53 import api
from glm53.equality import compare_streams
from serving.engine import EngineArgs, LLMEngine
from serving.engine_factory import build_engine
from sharding.mesh import ParallelConfig
from tests.helpers.conversations import run_conversations
from tests.helpers.hisparse_pool import check_host_pool_bytes, replicas
from tests.helpers.host_memory import host_memory_reads

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

AMPLE = 160
# One step bucket of 16 tokens: every engine compiles one hot-path and one plain program (plus the
# store program) — compiles dominate these tests on simulated devices; under pressure a request
# with pages off the device prefills 1024 / 64 = 16 rows per step anyway.
MBT = 16
# By DCP size: the workload and a device pool far too small for it (pages per arena shard, the
# null page included). One device: a 400-token first turn needs 7 MLA + 1 indexer pages of 64
# tokens, three run at once on 9 usable pages. DCP2 (engine pages of 128 tokens): a request's
# HiSparse footprint (indexer page, hot lease of 2 pages — each rank's hot buffer is as large as
# one device's — and 2 tail pages) only pays against contexts of many pages, so the first turns
# are 900 tokens (8 MLA + 1 indexer pages) on 17 usable pages.
CONVS = {1: dict(conversations=3, turns=2, first_tokens=400, new_tokens=24, max_tokens=8),
         2: dict(conversations=3, turns=2, first_tokens=900, new_tokens=24, max_tokens=8)}
SMALL = {1: 10, 2: 18}
CONV = CONVS[1]


def hisparse(mechanism: str, prefill_buffer_size: int = 1024) -> dict:
    return {"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": prefill_buffer_size,
                                "host_gather": mechanism}}


# Layouts whose prefill lease holds the worst case of only 2 query rows (128 rows per rank): their
# chunks are sized by what the selections fill (adaptive prefill sizing) and some overflow the
# lease and are truncated at their first dropped selection, found over the DCP ranks (and over
# the PCP ranks' token shares, and per DP replica).
SMALL_PREFILL_LEASE = {"pcp2_dcp2": 128, "dp2_tp2_dcp2": 128}
# Layouts served with asynchronous scheduling (serving/async_scheduling.py): DP replicas' stacked
# step, the callback host pool, DCP and truncated chunks read back before the next schedule
# (pcp2_dcp2 keeps the synchronous engine's truncation).
ASYNC = {"dp2_tp2_dcp2"}


def build(num_blocks: int, parallel: ParallelConfig | None = None, attention_config=None, **kw) -> LLMEngine:
    args = EngineArgs(dtype="float32", max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=MBT,
                      cuda_graph_sizes=[], precompile_token_paddings=[], num_gpu_blocks_override=num_blocks, compile_progress=False,
                      disable_log_stats=True, enable_prefix_caching=True, attention_config=attention_config,
                      parallel=parallel, **kw)
    return build_engine(args)


_REFERENCES: dict = {}


def reference_for(dcp: int):
    """The single-device run of `CONVS[dcp]` on an ample pool without HiSparse (top-2 logprobs for
    the rule), computed once per module."""
    if dcp not in _REFERENCES:
        if "engine" not in _REFERENCES:  # one engine (one compile) serves both workloads
            _REFERENCES["engine"] = build(AMPLE)
        _REFERENCES[dcp] = run_conversations(_REFERENCES["engine"], logprobs=2, **CONVS[dcp])
    return _REFERENCES[dcp]


@pytest.fixture(scope="module")
def lm():
    return api.load(dtype=jnp.float32, cache_dtype="float32")


def preemptions(engine) -> int:
    scheds = [r.scheduler for r in engine.replicas] if hasattr(engine, "replicas") else [engine.scheduler]
    return sum(s.num_preemptions_total for s in scheds)


LAYOUTS = {
    # TP2 inside each of two DP replicas, experts over both (one host copy per replica, its columns
    # split over the TP ranks; a host pool, policy and hot state per replica).
    "dp2_tp2_ep": (ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
                   "memory_kind"),
    "tp2_dcp2": (ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2), "callback"),
    "pcp2_dcp2": (ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2), "memory_kind"),
    "dp2_tp2_dcp2": (ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, decode_context_parallel_size=2),
                     "callback"),
}


# Layouts served with MTP speculation (k = 2) and an oracle drafter (the reference continuation:
# every draft accepted, so every decode step verifies 3 rows per request, each of which may miss
# its whole top-k on either DCP rank or in either replica): the reference's decode engine runs
# HiSparse with MTP3. The hot lease per decoding request is then 4 pages (2 without MTP): the
# pool gets `MTP_PAGES` more (the MTP layer's rows are one more layer of each group, no pages of
# their own).
MTP_LAYOUTS = {"tp2_dcp2", "dp2_tp2_ep"}
MTP_PAGES = {1: 2, 2: 4}


def host_reads_of_the_programs(engine) -> list[tuple[str, str]]:
    """Host-memory reads of the engine's hot-path step and store program (`tests/helpers/host_memory`)."""
    r = engine.runner
    batch, extra = r._dummy(r.buckets[0])
    step = host_memory_reads(jax.make_jaxpr(r._step)(r._state_leaves, r._place(batch), r.kv_arena, *extra,
                                                     r._hisparse_args()))
    src, dst = r.hisparse.store_lists([])
    return step + host_memory_reads(jax.make_jaxpr(r._store_only)(r.hisparse.pool, r.kv_arena, src, dst))


def record_store_ordering(engine) -> tuple[list[int], set[int]]:
    """Callback mechanism: → (the `after` operand of every host read, the completion values the
    store programs returned), filled while `engine` runs."""
    runner, store = engine.runner, engine.hisparse.device.pool
    afters, dones = [], set()
    gather, run_store_lists = store._gather, runner.run_store_lists

    def recording_gather(rows, col_start, num_cols, after):
        afters.append(int(np.asarray(after)))
        return gather(rows, col_start, num_cols, after)

    def recording_store_lists(src, dst, wait=False):
        run_store_lists(src, dst, wait)
        dones.update(int(x) for x in np.asarray(runner.hisparse.after).reshape(-1))

    store._gather = recording_gather  # the compiled callbacks look the method up on the store
    runner.run_store_lists = recording_store_lists
    return afters, dones


class Interference:
    """DP2: mid-run (from step 10 on), abort a decoding request of replica 0, then preempt a
    running request of replica 1 (its pages and host blocks freed, recomputed later)."""

    def __init__(self):
        self.aborted = self.preempted = None

    def __call__(self, e, i):
        if i < 10:
            return
        if self.aborted is None:
            victim = next((r for r in e.replicas[0].scheduler.running if r.num_output_tokens > 0), None)
            if victim is not None:
                self.aborted = victim.request_id
                e.abort(victim.request_id)
        elif self.preempted is None and e.replicas[1].scheduler.running:
            s1 = e.replicas[1].scheduler
            victim = s1.running[-1]
            self.preempted = victim.request_id
            s1.running.remove(victim)
            s1._preempt(victim)
            assert e.audit() == []


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_streams_equal_the_single_device_ample_run(name, lm):
    """Under DP2 × TP2 + EP one replica also sees an abort and the other a preemption
    (`Interference`): every other stream — the preempted one included — still equals the
    reference, the aborted one is its prefix. TP2 × DCP2 and DP2 × TP2 + EP run MTP speculation
    (`MTP_LAYOUTS`): the streams are still those of the single-device run without it, and the
    clean host blocks checked include the MTP layer's rows."""
    par, mechanism = LAYOUTS[name]
    dcp = par.decode_context_parallel_size
    reference = reference_for(dcp)
    mtp = name in MTP_LAYOUTS
    engine = build(SMALL[dcp] + (MTP_PAGES[dcp] if mtp else 0), par,
                   hisparse(mechanism, SMALL_PREFILL_LEASE.get(name, 1024)), async_scheduling=name in ASYNC,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 2} if mtp else None)
    assert engine.async_scheduling == (name in ASYNC)
    if mtp:
        assert engine.hisparse.config.device_buffer_rows == 4 * 64  # (k + 2) × index_topk rows per rank

        def oracle(req, n):
            c, t = (int(x) for x in req.request_id[1:].split("t"))
            return (reference.outputs[(c, t)][req.num_output_tokens:] + [0] * n)[:n]

        engine.drafter_override = oracle
    if mechanism == "memory_kind":  # on a GPU the host pool allows only slices and moves
        reads = host_reads_of_the_programs(engine)
        assert [x for x in reads if x[1] != "ok"] == []
        assert {"dynamic_slice", "device_put", "dynamic_update_slice"} <= {n for n, _ in reads}
    checked = []
    interfere = Interference() if par.data_parallel_size > 1 and dcp == 1 else None
    if mechanism == "callback":
        afters, dones = record_store_ordering(engine)

    def on_step(e, i):
        if interfere is not None:
            interfere(e, i)
        if i % 6 == 5:
            checked.append(check_host_pool_bytes(e))

    run = run_conversations(engine, **CONVS[dcp], on_step=on_step)
    d = engine.hisparse.device
    print(f"\n{name}: {engine.runner.num_hot_steps} hot steps, hits {d.hits}, misses {d.misses}, "
          f"{d.h2d_bytes} B host->device, {sum(checked)} host blocks checked")
    want = dict(reference.outputs)
    if interfere is not None:
        assert interfere.aborted and interfere.preempted
        key = tuple(int(x) for x in interfere.aborted[1:].split("t"))
        got = run.outputs.pop(key)
        assert 0 < len(got) < CONVS[dcp]["max_tokens"] and got == want[key][:len(got)]
        want = {k: v for k, v in want.items() if k in run.outputs}
        assert [r.scheduler.num_preemptions_total for r in engine.replicas] == [0, 1]
    else:
        assert preemptions(engine) == 0
    compare_streams(want, run.outputs, reference.logprobs, reference.prompts, lm)
    assert engine.runner.num_hot_steps > 0 and d.misses > 0 and d.drops_outside_truncation == 0  # rows came from the host
    if mtp:
        s = engine.spec_stats
        assert s.num_accepted_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens  # every draft accepted
    # The counters come back per KV shard, replica-major (summed on the host in 64-bit): every
    # DCP rank of a replica that missed rows missed rows of its own positions.
    per_replica = d.misses_per_shard.reshape(par.data_parallel_size, dcp)
    assert int(per_replica.sum()) == d.misses
    assert all((r > 0).all() for r in per_replica if r.any()), per_replica
    if name in SMALL_PREFILL_LEASE:
        assert sum(p.num_truncated_chunks for p in engine.hisparse.policies) > 0 and d.dropped > 0
    assert sum(checked) > 0
    if mechanism == "callback":
        # The step's host reads took the last store program's completion value as an operand
        # (the data dependency that orders them after the stores; the callbacks are unordered):
        # only values a store program returned (or the initial 0) reach them, and non-zero ones
        # do. Without the dependency every read sees 0.
        assert set(afters) <= dones | {0} and max(afters) > 0, (sorted(set(afters)), sorted(dones))
    for kv, pol in replicas(engine):  # nothing leaked, on the device or the host
        assert kv.pool.num_free == kv.pool.num_usable_blocks
        assert pol.host.blocks.num_free == pol.host.num_usable


@pytest.mark.parametrize("argv", [["-tp", "2"], ["-tp", "2", "-dcp", "2"], ["-dp", "2", "--enable-expert-parallel"],
                                  ["-pcp", "2", "-dcp", "2"], ["-dp", "2", "-tp", "2", "-dcp", "2"]])
def test_cli_accepts_hisparse_on_every_parallel_layout(argv):
    """... with the offloading connector beside it, as the reference's decode engine runs."""
    from serving.cli_args import make_arg_parser, validate_args

    connector = ('{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
                 '{"cpu_bytes_to_use": 1073741824}}')
    args = make_arg_parser().parse_args(["--attention-config", '{"hisparse_config": {"host_pool_gib": 1}}', *argv,
                                         "--enable-prefix-caching", "--kv-transfer-config", connector])
    validate_args(args)
    assert args.attention_config["hisparse_config"]["host_pool_gib"] == 1
    assert args.kv_transfer_config["kv_connector"] == "OffloadingConnector"

