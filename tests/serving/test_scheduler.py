"""Scheduler: continuous batching, chunked prefill, preemption by recompute, stops, aborts.

The "model" is a deterministic function of the token history. The fake runner runs the step's
page copies, writes every scheduled token into a simulated paged arena through the slot mappings
of every KV cache group and reads the whole history back through the block tables before
sampling, so a page that is shared, reused too early, copied wrongly or left stale changes the
tokens. Every test compares token streams with a
reference that runs each request alone (no batching, no paging, no preemption).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from serving.block_pool import BlockPool
from serving.kv_cache import KVCacheGroupSpec, KVCacheManager
from serving.offload.store import OffloadStore
from serving.prefix_cache import PrefixCache
from serving.request import Request, RequestStatus
from serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from serving.types import SamplingParams

VOCAB = 97
EOS = 1000  # outside the vocabulary unless a test picks a reachable id


def next_token(history) -> int:
    h = 0
    for t in history:
        h = (h * 31 + int(t) + 1) % 1_000_003
    return (h * 7 + len(history)) % VOCAB


def reference(req: Request, eos: set[int], max_model_len: int) -> tuple[list[int], str]:
    """Generate for one request alone."""
    p = req.sampling_params
    hist = list(req.prompt_token_ids)
    out: list[int] = []
    while True:
        t = next_token(hist)
        hist.append(t)
        out.append(t)
        if (not p.ignore_eos and t in eos) or t in p.stop_token_ids:
            return out, "stop"
        if len(hist) >= max_model_len or (p.max_tokens is not None and len(out) >= p.max_tokens):
            return out, "length"


class FakeRunner:
    """Writes KV through slot mappings into a paged arena, reads it back through block tables."""

    def __init__(self, kv: KVCacheManager, tokens_per_step: int = 1, offload=None):
        self.kv = kv
        self.tokens_per_step = tokens_per_step
        max_tpp = max(g.tokens_per_page for g in kv.groups)
        self.arena = np.full((kv.pool.num_blocks, max_tpp), -1, dtype=np.int64)
        self.num_copies = 0
        self.offload = offload  # an OffloadStore: its stores and the step's loads run first
        if offload is not None:
            self.host = np.full((offload.blocks.num_blocks, max_tpp), -1, dtype=np.int64)

    @staticmethod
    def _encode(token, pos, gi):
        return (np.asarray(token, np.int64) * 100_000 + pos) * 10 + gi

    def _slots(self, rid, g, positions):
        slots = self.kv.slot_mapping(rid, g.name, positions)
        assert (slots >= 0).all()
        return slots // g.tokens_per_page, slots % g.tokens_per_page

    def step(self, out: SchedulerOutput) -> dict[str, list[int]]:
        # The connector's stores, then its loads (ModelRunner.run_offload), then page copies,
        # then every write of the step (like one forward pass), then the reads.
        if self.offload is not None:
            for job in self.offload.take_stores(len(self.offload.queue)):
                assert self.offload.blocks.refcount(job.host_block) == 1
                self.host[job.host_block] = self.arena[job.device_block]
            for hb, dst in out.page_loads:
                assert self.offload.blocks.refcount(hb) >= 1, "load from an unpinned host block"
                assert self.kv.pool.refcount(dst) == 1
                self.arena[dst] = self.host[hb]
        srcs, dsts = [c[0] for c in out.page_copies], [c[1] for c in out.page_copies]
        assert not set(srcs) & set(dsts) and len(set(dsts)) == len(dsts)
        for src, dst in out.page_copies:
            assert self.kv.pool.refcount(src) >= 1 and self.kv.pool.refcount(dst) == 1
            self.arena[dst] = self.arena[src]
        self.num_copies += len(out.page_copies)
        for sr in out.scheduled:
            assert sr.request.status is RequestStatus.RUNNING
            tokens = sr.token_ids
            assert len(tokens) == sr.num_new_tokens > 0
            for gi, g in enumerate(self.kv.groups):
                blk, off = self._slots(sr.request_id, g, sr.positions)
                assert (blk != 0).all()
                assert all(self.kv.pool.refcount(int(b)) == 1 for b in blk), "write to a shared page"
                self.arena[blk, off] = self._encode(tokens, sr.positions, gi)
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if not sr.sample:
                continue
            end = sr.start_pos + sr.num_new_tokens
            req = sr.request
            assert end == req.num_tokens
            positions = np.arange(end)
            for gi, g in enumerate(self.kv.groups):
                blk, off = self._slots(req.request_id, g, positions)
                assert self.arena[blk, off].tolist() == self._encode(
                    req.all_token_ids, positions, gi).tolist(), "KV read back differs"
            hist = list(req.all_token_ids)
            toks = []
            for _ in range(self.tokens_per_step):  # several tokens: accepted drafts, say
                toks.append(next_token(hist))
                hist.append(toks[-1])
            sampled[req.request_id] = toks
        return sampled


class Engine:
    def __init__(self, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96,
                 long_prefill_token_threshold=0, eos=(EOS,), tokens_per_step=1, prefix_caching=False,
                 offload_blocks=0):
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(
            self.pool,
            [KVCacheGroupSpec("mla", 4), KVCacheGroupSpec("indexer", 16)],
            {"mla": -(-max_model_len // 4), "indexer": -(-max_model_len // 16)},
        )
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                                      long_prefill_token_threshold)
        self.offload = OffloadStore(offload_blocks, ("mla", "indexer"), 1) if offload_blocks else None
        self.prefix_cache = PrefixCache(self.kv, offload=self.offload) if prefix_caching else None
        self.evicted: list[int] = []
        if self.prefix_cache is not None:
            def on_reuse(block, tag):
                self.evicted.append(block)
                assert self.prefix_cache.on_block_reuse(block, tag)
            self.pool.on_reuse = on_reuse
        self.sched = Scheduler(self.config, self.kv, eos, self.prefix_cache)
        self.eos = set(eos)
        self.runner = FakeRunner(self.kv, tokens_per_step, self.offload)
        self.streams: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.steps: list[SchedulerOutput] = []
        self.added: dict[str, Request] = {}

    def add(self, rid, prompt, **params):
        req = Request(rid, list(prompt), SamplingParams(**params))
        self.sched.add_request(req)
        self.added[rid] = req
        return req

    def step(self):
        out = self.sched.schedule()
        cfg = self.config
        assert out.num_scheduled_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len(self.sched.running) <= cfg.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        rows = [s.request.state_row for s in out.scheduled]
        assert len(set(rows)) == len(rows) and all(0 <= r < cfg.max_num_seqs for r in rows)
        if cfg.long_prefill_token_threshold:
            assert all(s.num_new_tokens <= cfg.long_prefill_token_threshold for s in out.scheduled)
        assert self.sched.audit() == []
        sampled = self.runner.step(out)
        for o in self.sched.update_from_output(out, sampled):
            assert o.request_id not in self.reasons, "output after the final one"
            self.streams.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.num_output_tokens == len(self.streams[o.request_id])
            if o.finished:
                self.reasons[o.request_id] = o.finish_reason
        if self.offload is not None:
            self.offload.complete()
            self.offload.unpin()
            assert self.offload.audit() == []
        assert self.sched.audit() == []
        self.steps.append(out)
        return out

    def run(self, max_steps=5000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("did not finish")

    def drive(self, rng, arrivals, add, abort_rate, max_steps):
        """Step until every arrival `(step, rid)` was added (`add(rid)`, at its step) and every
        request finished; each step a live request is aborted with probability `abort_rate`.
        Returns the aborted ids."""
        pending, aborted = list(arrivals), set()
        for step in range(max_steps):
            for t, rid in [x for x in pending if x[0] <= step]:
                add(rid)
                pending.remove((t, rid))
            if rng.random() < abort_rate and self.sched.requests:
                rid = rng.choice(sorted(self.sched.requests))
                assert self.sched.abort(rid).finish_reason == "abort"
                aborted.add(rid)
            if not pending and not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not pending and not self.sched.has_unfinished_requests()
        return aborted

    def check_against_reference(self, skip=()):
        for rid, req in self.added.items():
            if rid in skip:
                continue
            tokens, reason = reference(req, self.eos, self.config.max_model_len)
            assert self.streams.get(rid) == tokens, rid
            assert self.reasons[rid] == reason, rid
            assert req.output_token_ids == tokens


@pytest.fixture
def make_engine():
    """Builds engines; at teardown every engine must audit clean and hold no pages."""
    engines: list[Engine] = []

    def make(**kw) -> Engine:
        engines.append(Engine(**kw))
        return engines[-1]

    yield make
    for e in engines:
        assert e.sched.audit() == []
        if not e.sched.has_unfinished_requests():
            assert e.pool.num_free == e.pool.num_usable_blocks
            assert e.kv.request_ids() == []


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_single_request(make_engine):
    e = make_engine()
    e.add("a", prompt(0, 10), max_tokens=7)
    e.run()
    e.check_against_reference()
    assert e.reasons["a"] == "length" and len(e.streams["a"]) == 7
    assert [s.num_new_tokens for s in e.steps[0].scheduled] == [10]
    assert all(s.scheduled[0].num_new_tokens == 1 for s in e.steps[1:])
    assert e.sched.num_preemptions_total == 0


def test_chunked_prefill_respects_budget_and_decodes_go_first(make_engine):
    e = make_engine(max_num_batched_tokens=8, num_blocks=128)
    e.add("a", prompt(1, 5), max_tokens=12)
    e.step()  # a prefills in one step
    e.add("b", prompt(2, 30), max_tokens=4)
    out = e.step()
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        ("a", 1, True), ("b", 7, False)]
    chunks = [next(s for s in o.scheduled if s.request_id == "b") for o in e.steps[1:]]
    while not chunks or chunks[-1].num_new_tokens != 1:
        out = e.step()
        b = [s for s in out.scheduled if s.request_id == "b"]
        if b:
            chunks.append(b[0])
        if "b" in e.streams:
            break
    assert [c.num_new_tokens for c in chunks[:5]] == [7, 7, 7, 7, 2]
    assert [c.start_pos for c in chunks[:5]] == [0, 7, 14, 21, 28]
    assert [c.sample for c in chunks[:5]] == [False] * 4 + [True]
    assert chunks[0].first_chunk and not any(c.first_chunk for c in chunks[1:])
    e.run()
    e.check_against_reference()


def test_long_prefill_threshold(make_engine):
    e = make_engine(max_num_batched_tokens=32, long_prefill_token_threshold=5, num_blocks=128)
    e.add("a", prompt(3, 23), max_tokens=3)
    e.add("b", prompt(4, 11), max_tokens=3)
    out = e.step()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 5), ("b", 5)]
    e.run()
    e.check_against_reference()


def test_never_more_than_max_num_seqs(make_engine):
    e = make_engine(max_num_seqs=3, num_blocks=256, max_num_batched_tokens=64)
    for i in range(10):
        e.add(f"r{i}", prompt(10 + i, 3 + i), max_tokens=2 + (i * 3) % 7)
    seen_running = []
    while e.sched.has_unfinished_requests():
        e.step()
        seen_running.append(e.sched.num_requests_running)
    assert max(seen_running) == 3
    e.check_against_reference()
    # Admission is first come, first served.
    first = {}
    for k, out in enumerate(e.steps):
        for s in out.scheduled:
            first.setdefault(s.request_id, k)
    order = sorted(first, key=lambda r: (first[r], int(r[1:])))
    assert order == [f"r{i}" for i in range(10)]


def test_preemption_recomputes_to_identical_tokens(make_engine):
    # 24 usable pages; one request of 60 tokens needs 15 + 4 = 19 pages: only one fits at a time
    # once they grow, so the newest running request is preempted again and again.
    e = make_engine(num_blocks=25, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    for i in range(4):
        e.add(f"r{i}", prompt(20 + i, 6 + 3 * i), max_tokens=40 - 4 * i, ignore_eos=True)
    resumed = []
    while e.sched.has_unfinished_requests():
        out = e.step()
        for rid in out.preempted:
            req = e.added[rid]
            assert req.status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
        for s in out.scheduled:
            if s.first_chunk and s.request.num_preemptions:
                resumed.append(s.request_id)
                assert s.start_pos == 0
    assert e.sched.num_preemptions_total > 0 and resumed
    assert sum(r.num_preemptions for r in e.added.values()) == e.sched.num_preemptions_total
    e.check_against_reference()


def test_preempted_request_goes_to_the_front_and_frees_its_pages(make_engine):
    e = make_engine(num_blocks=13, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=36)
    # 12 usable pages, each request of n tokens needs ceil(n/4) + ceil(n/16) pages.
    e.add("a", prompt(30, 14), max_tokens=30, ignore_eos=True)  # 4 + 1 pages
    e.add("b", prompt(31, 14), max_tokens=30, ignore_eos=True)
    e.step()
    assert e.sched.num_requests_running == 2 and e.pool.num_free == 2
    e.add("c", prompt(32, 4), max_tokens=3)
    while not e.steps[-1].preempted:
        e.step()
    out = e.steps[-1]
    assert out.preempted == ["c"]  # the most recently started request
    assert e.sched.waiting[0].request_id == "c"
    c = e.added["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.state_row is None and not e.kv.has_request("c") and c.num_computed_tokens == 0
    assert not any(s.first_chunk for s in out.scheduled)  # no admissions in a preempting step
    e.add("d", prompt(33, 2), max_tokens=2)
    assert [r.request_id for r in e.sched.waiting] == ["c", "d"]
    e.run()
    e.check_against_reference()


def test_abort_frees_pages(make_engine):
    e = make_engine(num_blocks=64, max_num_seqs=2)
    e.add("a", prompt(40, 12), max_tokens=50)
    e.add("b", prompt(41, 12), max_tokens=50)
    e.add("c", prompt(42, 12), max_tokens=50)
    e.step()
    e.step()
    assert e.sched.num_requests_running == 2 and e.sched.num_requests_waiting == 1
    usage = e.sched.kv_cache_usage
    out_a = e.sched.abort("a")  # running
    assert out_a.finished and out_a.finish_reason == "abort" and out_a.new_token_ids == []
    assert out_a.num_output_tokens == 2  # the prefill's token and one decode
    assert not e.kv.has_request("a") and e.sched.kv_cache_usage < usage
    assert e.added["a"].status is RequestStatus.FINISHED_ABORTED and e.added["a"].state_row is None
    out_c = e.sched.abort("c")  # waiting
    assert out_c.finish_reason == "abort" and e.sched.num_requests_waiting == 0
    assert e.sched.abort("c") is None and e.sched.abort("zzz") is None
    assert e.sched.audit() == []
    nxt = e.step()
    assert set(nxt.finished_ids) == {"a", "c"}
    # Abort between schedule() and update_from_output(): the step's result is dropped.
    out = e.sched.schedule()
    sampled = e.runner.step(out)
    e.sched.abort("b")
    assert e.sched.update_from_output(out, sampled) == []
    assert e.pool.num_free == e.pool.num_usable_blocks
    assert not e.sched.has_unfinished_requests()


def test_max_tokens_eos_stop_tokens_and_max_model_len(make_engine):
    p = prompt(50, 9)
    probe = Request("probe", p, SamplingParams(max_tokens=6))
    toks, _ = reference(probe, set(), 10_000)
    eos = toks[2]
    e = make_engine(eos=(eos,), max_model_len=24)
    e.add("eos", p, max_tokens=6)
    e.add("ignore", p, max_tokens=6, ignore_eos=True)
    e.add("stop", p, max_tokens=6, stop_token_ids=[toks[1]])
    e.add("mml", p, max_tokens=None, ignore_eos=True)
    e.add("mt1", p, max_tokens=1)
    e.run()
    e.check_against_reference()
    first_eos = toks.index(eos)
    assert e.streams["eos"] == toks[: first_eos + 1] and e.reasons["eos"] == "stop"
    assert e.streams["ignore"] == toks and e.reasons["ignore"] == "length"
    assert e.streams["stop"][-1] == toks[1] and e.reasons["stop"] == "stop"
    assert len(p) + len(e.streams["mml"]) == 24 and e.reasons["mml"] == "length"
    assert len(e.streams["mt1"]) == 1 and e.reasons["mt1"] == "length"


def test_stop_wins_over_length_on_the_same_token(make_engine):
    p = prompt(51, 5)
    toks, _ = reference(Request("x", p, SamplingParams(max_tokens=3)), set(), 10_000)
    e = make_engine(eos=(toks[2],))
    assert toks[2] not in toks[:2], "precondition: the third token does not occur earlier in this stream"
    e.add("a", p, max_tokens=3)
    e.run()
    assert e.streams["a"] == toks and e.reasons["a"] == "stop"


def test_add_request_validation(make_engine):
    e = make_engine(max_model_len=32)
    with pytest.raises(ValueError):
        e.add("empty", [])
    with pytest.raises(ValueError):
        e.add("long", prompt(60, 32))
    e.add("ok", prompt(61, 31), max_tokens=5)  # room for one token
    with pytest.raises(ValueError):
        e.add("ok", prompt(62, 3))
    with pytest.raises(ValueError):
        e.add("bad", prompt(63, 3), top_p=0.0)
    e.run()
    assert e.streams["ok"] == reference(e.added["ok"], e.eos, 32)[0] and len(e.streams["ok"]) == 1


def test_prompt_larger_than_the_pool_is_rejected_and_growth_stops_at_the_pool(make_engine):
    # 6 usable pages hold at most 16 tokens (4 mla + 1 indexer pages; 17 tokens need 5 + 2).
    e = make_engine(num_blocks=7, max_model_len=64)
    with pytest.raises(ValueError, match="does not fit"):
        e.add("huge", prompt(70, 30))
    e.add("grow", prompt(71, 10), max_tokens=None, ignore_eos=True)
    e.run()
    n = len(e.added["grow"].all_token_ids)
    assert e.reasons["grow"] == "length"
    assert sum(e.kv.pages_for_tokens(n - 1).values()) <= 6 < sum(e.kv.pages_for_tokens(n).values())


def test_scheduler_rejects_caps_below_max_model_len():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, [KVCacheGroupSpec("mla", 4)], {"mla": 2})
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(2, 16, 64), kv, [EOS])
    with pytest.raises(ValueError):
        SchedulerConfig(0, 16, 64)


def test_tokens_for_a_non_sampling_chunk_are_rejected(make_engine):
    e = make_engine(max_num_batched_tokens=4)
    e.add("a", prompt(80, 10), max_tokens=2)
    out = e.sched.schedule()
    assert not out.scheduled[0].sample
    assert e.runner.step(out) == {}
    with pytest.raises(ValueError):
        e.sched.update_from_output(out, {"a": [3]})
    assert e.sched.update_from_output(out, {}) == []
    e.run()
    e.check_against_reference()


def test_several_tokens_per_step(make_engine):
    """Two tokens per sampling step (as with accepted draft tokens): the next step schedules two
    query rows for the request, and a stop inside the list truncates it."""
    e = make_engine(tokens_per_step=2, num_blocks=128)
    e.add("a", prompt(90, 7), max_tokens=9, ignore_eos=True)
    e.add("b", prompt(91, 4), max_tokens=6, ignore_eos=True)
    e.run()
    e.check_against_reference()
    assert any(s.num_new_tokens == 2 for o in e.steps[1:] for s in o.scheduled)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_tiny_pool(make_engine, seed):
    rng = random.Random(seed)
    e = make_engine(num_blocks=rng.choice([20, 30, 60]), max_num_seqs=rng.choice([2, 3, 5]),
                    max_num_batched_tokens=rng.choice([8, 16, 40]), max_model_len=64,
                    long_prefill_token_threshold=rng.choice([0, 6]))
    arrivals = [(rng.randrange(40), f"r{i}") for i in range(12)]
    aborted = e.drive(rng, arrivals, lambda rid: e.add(rid, prompt(1000 * seed + int(rid[1:]), rng.randint(1, 30)),
                                                      max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5),
                      0.02, 4000)
    e.check_against_reference(skip=aborted)
