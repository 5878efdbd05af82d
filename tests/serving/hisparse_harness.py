"""A scheduler + HiSparse policy harness over a simulated arena and host pool (no model).

`FakeHiSparseRunner` plays the device step: it runs the step's write-through copies first (arena
page → host block, refusing a page that is not fully written), then the page copies, then every
write (only into owned, sole-owned pages), and before each sample reads the request's whole
history back — resident and released-but-intact MLA pages from the arena, off-device pages from
the host block the policy names (which must hold a complete copy). It also checks the hot-buffer
sizing rule the real resolver relies on: a request with off-device pages gets more query rows
than its lease can take misses for only under adaptive prefill sizing, and then the step may
overflow the lease like the real resolver — the fake runner truncates such a chunk at a random
row (half the time), writes wrong KV for the rows past it (as the real step does) and samples
nothing for it; the engine loop applies `serving.hisparse.truncation.truncate_step`. Any page
reused too early, copied too late, released while dirty, read after reuse, or a truncated row's
KV kept (sealed, cached, read) changes the tokens, which are compared with each request run alone
(`tests/serving/test_scheduler.reference`).
"""

from __future__ import annotations

import numpy as np

from serving.block_pool import BlockPool
from serving.hisparse.config import HiSparseConfig, ResolvedHiSparse
from serving.hisparse.host_pool import HostPool
from serving.hisparse.residency import HiSparsePolicy
from serving.hisparse.truncation import truncate_step
from serving.kv_cache import KVCacheGroupSpec, KVCacheManager
from serving.prefix_cache import PrefixCache
from serving.request import Request, RequestStatus
from serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from serving.types import SamplingParams
from tests.serving.test_scheduler import EOS, next_token, reference

MLA_TPP, IDX_TPP = 4, 16


class FakeHiSparseRunner:
    def __init__(self, kv: KVCacheManager, policy: HiSparsePolicy, host_blocks: int, max_copies: int):
        self.kv, self.policy, self.max_copies = kv, policy, max_copies
        self.arena = np.full((kv.pool.num_blocks, IDX_TPP), -1, dtype=np.int64)
        self.host = np.full((host_blocks, MLA_TPP), -1, dtype=np.int64)
        self.host_reads = 0
        self.num_stores = 0
        self.rng = np.random.default_rng(0)
        self.last_truncated: dict[str, int] = {}  # request → the position its chunk is valid up to
        self.num_truncated = 0

    @staticmethod
    def _encode(token, pos, gi):
        return (np.asarray(token, np.int64) * 100_000 + pos) * 10 + gi

    def step(self, out: SchedulerOutput) -> dict[str, list[int]]:
        kv, pol = self.kv, self.policy
        for job in pol.take_stores(self.max_copies):  # write-through copies, before any write
            page = self.arena[job.device_block, :MLA_TPP]
            assert (page >= 0).all(), "copying a page that is not fully written"
            assert (page % 10 == 0).all(), "copying a page that is not an MLA page"
            self.host[job.host_block] = page
            self.num_stores += 1
        for src, dst in out.page_copies:
            self.arena[dst] = self.arena[src]
        self.last_truncated = {}
        for sr in out.scheduled:
            rid = sr.request_id
            assert sr.request.status is RequestStatus.RUNNING
            off = pol.off_pages(rid)
            valid = sr.num_new_tokens
            if off:
                rec = pol.records[rid]
                rows = len(rec.lease) * MLA_TPP
                assert rows >= pol.least_pages * MLA_TPP
                if min(sr.num_new_tokens * pol.K, off * MLA_TPP) > rows:  # past the worst-case bound
                    assert pol.adaptive and sr.num_spec_tokens == 0, "lease too small for the step"
                    if self.rng.random() < 0.5:  # the selections overflowed the lease
                        valid = int(self.rng.integers(0, sr.num_new_tokens))
                        self.last_truncated[rid] = sr.start_pos + valid
                        self.num_truncated += 1
            for gi, g in enumerate(kv.groups):
                slots = kv.slot_mapping(rid, g.name, sr.positions)
                t = kv.table(rid, g.name)
                for p, s in zip(sr.positions, slots):
                    assert s >= 0 and t.is_owned(int(p) // g.tokens_per_page), "write to a page not owned"
                    assert kv.pool.refcount(int(s) // g.tokens_per_page) == 1, "write to a shared page"
                blk, o = slots // g.tokens_per_page, slots % g.tokens_per_page
                toks = np.asarray(sr.token_ids, np.int64)
                toks[valid:] += 7  # a truncated chunk's rows past the cut hold wrong KV
                self.arena[blk, o] = self._encode(toks, sr.positions, gi)
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if not sr.sample or sr.request_id in self.last_truncated:
                continue
            req = sr.request
            rid = req.request_id
            end = req.num_tokens
            pos = np.arange(end)
            for gi, g in enumerate(kv.groups):
                want = self._encode(req.all_token_ids, pos, gi)
                t = kv.table(rid, g.name)
                if g.name == "mla":
                    host = pol.host_table(rid, len(t.blocks))
                    got = []
                    for p in pos:
                        i, o = divmod(int(p), MLA_TPP)
                        if i in t.placeholders:
                            assert host[i] > 0, f"page {i} of {rid} is off the device without a host copy"
                            got.append(self.host[host[i], o])
                            self.host_reads += 1
                        else:
                            got.append(self.arena[t.blocks[i], o])
                else:
                    slots = kv.slot_mapping(rid, g.name, pos)
                    assert (slots >= 0).all()
                    got = self.arena[slots // g.tokens_per_page, slots % g.tokens_per_page]
                assert list(map(int, got)) == want.tolist(), f"KV of {rid} read back differs in {g.name}"
            sampled[rid] = [next_token(req.all_token_ids)]
        return sampled


class HiSparseEngine:
    """Scheduler + HiSparse policy + fake runner. index_topk K, hot rows in tokens."""

    def __init__(self, num_blocks=40, host_blocks=200, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=160,
                 K=4, device_buffer=8, prefill_buffer=32, prefix_caching=False, watermark=0.1,
                 prefill_sizing="adaptive", prefill_buffer_max=None):
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, [KVCacheGroupSpec("mla", MLA_TPP), KVCacheGroupSpec("indexer", IDX_TPP)],
                                 {"mla": -(-max_model_len // MLA_TPP), "indexer": -(-max_model_len // IDX_TPP)})
        self.host_pool = HostPool(host_blocks)
        self.prefix_cache = PrefixCache(self.kv, host_pool=self.host_pool.blocks) if prefix_caching else None
        cfg = HiSparseConfig(1.0, device_buffer, prefill_buffer, "memory_kind", watermark, prefill_sizing,
                             prefill_buffer_max)
        resolved = ResolvedHiSparse(cfg, device_buffer, prefill_buffer_max or prefill_buffer, "memory_kind",
                                    prefill_buffer, K)
        self.policy = HiSparsePolicy(self.kv, self.host_pool, resolved, K, self.prefix_cache)

        def on_reuse(block, tag):
            if self.prefix_cache is not None and self.prefix_cache.on_block_reuse(block, tag):
                return
            self.kv.on_block_reuse(block, tag)

        self.pool.on_reuse = on_reuse
        if self.prefix_cache is not None:
            self.host_pool.blocks.on_reuse = lambda b, t: self.prefix_cache.on_host_block_reuse(b, t)
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
        self.sched = Scheduler(self.config, self.kv, (EOS,), self.prefix_cache, self.policy)
        self.runner = FakeHiSparseRunner(self.kv, self.policy, host_blocks,
                                         max_num_batched_tokens // MLA_TPP + 2 * max_num_seqs + 2)
        self.streams: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.added: dict[str, Request] = {}
        self.max_running = 0
        self.states_seen: set[str] = set()

    def add(self, rid, prompt, **params):
        req = Request(rid, list(prompt), SamplingParams(**params))
        self.sched.add_request(req)
        self.added[rid] = req
        return req

    def step(self):
        out = self.sched.schedule()
        assert self.sched.audit() == [], self.sched.audit()
        self.max_running = max(self.max_running, len(self.sched.running))
        for req in self.sched.running:
            self.states_seen.add(self.policy.residency(req))
        sampled = self.runner.step(out)
        out, sampled, kept = truncate_step(out, sampled, self.runner.last_truncated)
        self.policy.observe_step(kept)
        for o in self.sched.update_from_output(out, sampled):
            self.streams.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.reasons[o.request_id] = o.finish_reason
        assert self.sched.audit() == [], self.sched.audit()
        return out

    def flush(self):
        """An idle engine runs its queued write-through copies (a store-only step)."""
        while self.host_pool.queue:
            self.runner.step(SchedulerOutput())
            self.policy.after_update(SchedulerOutput())
        assert self.sched.audit() == [], self.sched.audit()

    def run(self, max_steps=20000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                self.flush()
                return
            self.step()
        raise AssertionError("did not finish")

    def check_against_reference(self, skip=()):
        for rid, req in self.added.items():
            if rid in skip:
                continue
            tokens, reason = reference(req, {EOS}, self.config.max_model_len)
            assert self.streams.get(rid) == tokens, rid
            assert self.reasons[rid] == reason, rid
