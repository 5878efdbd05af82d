"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

The baseline policy of docs/design.md §6 (after vLLM v1). Each `schedule()` call builds one step:

1. RUNNING requests in the order they started. Each gets the rest of its known tokens
   (`num_tokens - num_computed_tokens`: 1 for a decode, the remaining prompt for a request still
   prefilling), capped by `long_prefill_token_threshold` and by the step's token budget. If the
   pool cannot hold its KV, the most recently started running request is preempted (pages freed,
   `num_computed_tokens` reset to 0, put at the front of the waiting queue) and allocation is
   retried; a request that has to preempt itself stops the pass.
2. If nobody was preempted, WAITING requests are admitted first come first served while fewer
   than `max_num_seqs` run and budget remains. Admission is against the whole request, not its
   first chunk: pages for all of its known tokens (the prompt, plus the tokens generated before a
   preemption) are allocated at once, so a long prompt admitted in chunks never runs out of
   pages half-way and preempts itself (docs/design.md §6.1: room for the request fully resident).
   Admission stops at the first request whose pages do not fit. A policy may set an
   `admission_lookahead` L (HiSparse does): then, among the first L + 1 waiting requests, those
   whose prefix-cache hit covers at least half of their tokens (the next turn of a conversation:
   cheap to admit, and its cached prefix would be evicted while it waited) are tried first, each
   on its own, and the others after them in arrival order, stopping at the first that does not
   fit. A request passed over this way waits at most as long as the continuations admitted
   before it keep its room (SGLang's longest-prefix-first scheduling makes the same trade). A
   prompt longer than the remaining budget gets a chunk and continues next step.
   With a `PrefixCache`, an admitted request first looks up its longest cached prefix (in
   64-token units); the pages wholly inside the hit are shared (one more reference each), a page
   the hit ends inside is copied on write (`SchedulerOutput.page_copies`), and its computation
   starts after the hit.

With MTP speculation (`drafts`, `serving/spec_decode`), a decoding request carries the drafts
the previous step proposed after its decode token (`ScheduledRequest.num_spec_tokens`); the step
verifies them and `update_from_output` keeps the accepted ones (the rejected drafts' KV is not
counted, so the next step writes those slots again).

With asynchronous scheduling (`async_scheduling`, serving/async_scheduling.py) `schedule()` runs
while the previous step is on the device: a request that step samples for carries an output
placeholder (`Request.num_output_placeholders`) that counts as a known token, so it is scheduled
for its next decode row before its token is known (the runner feeds it on the device);
`mark_in_flight` counts a dispatched step's chunks as computed, and `update_from_output` then only
appends tokens. A request whose placeholders finish it anyway is not scheduled again.
Under MTP speculation a request with a step in flight is scheduled as if that step accepted none
of its drafts: its next rows are the token that step emits and the drafts it proposes
(`Request.num_draft_placeholders`, all fed on the device, which also moves the rows by the
accepted count), with pages for the most that step can accept (`Request.max_accepted_in_flight`,
the policy's `allocate(lookahead=)`: positions, not query rows);
`update_from_output` of the step in flight then adds the accepted drafts to `num_computed_tokens`.

A preempted request resumes by prefilling all of its tokens so far (prompt and generated ones),
so with a deterministic model it produces exactly the tokens it would have produced otherwise.

`update_from_output` takes the tokens sampled for the requests whose chunk reached the end of
their known tokens, appends them, applies the stop rules and frees finished requests.

The KV needed by a request with T tokens is T positions (the last token's KV is written by the
step that samples the next one). A request therefore finishes with "length" when its token count
reaches `max_model_len`, or earlier when the whole pool could not hold its next step (otherwise it
would preempt itself for ever).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from serving.kv_cache import KVCacheManager
from serving.kv_policy import DeviceResidentPolicy
from serving.prefix_cache import PrefixCache
from serving.prompt_logprobs import wants_prompt_logprobs
from serving.request import Request, RequestStatus
from serving.scheduler_output import ScheduledRequest, SchedulerOutput  # noqa: F401  (re-exported)
from serving.types import RequestOutput

_ABORT_STATUS = {"abort": RequestStatus.FINISHED_ABORTED, "stop": RequestStatus.FINISHED_STOPPED,
                 "error": RequestStatus.FINISHED_ERROR}


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits.

    max_num_seqs: most requests running at once (also the number of state rows).
    max_num_batched_tokens: most tokens (query rows) in one step.
    max_model_len: most tokens (prompt + generated) in one request.
    long_prefill_token_threshold: if > 0, most tokens one request gets in a step (long prompts
        are spread over several steps so decodes keep flowing); 0 disables the cap.

    Raises:
      ValueError: a limit < 1 (threshold < 0).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


class Scheduler:
    """Continuous-batching scheduler over a `KVCacheManager` (see the module docstring).

    Args:
      config: the limits.
      kv_cache_manager: the block tables; the scheduler allocates and frees through it.
      eos_token_ids: token ids that end a request (unless its sampling params say ignore_eos).
      prefix_cache: optional `PrefixCache` over the same manager (prefix caching on).
      policy: how pages are held (`serving/kv_policy.py`); default `DeviceResidentPolicy`
        (everything resident, preemption when the pool runs out).
      drafts: MTP speculative decoding (`serving.spec_decode.DraftController`) or None: a decoding
        request with `spec_token_ids` is scheduled with its drafts after its decode token (as
        many as the controller allows this step, the token budget, the pool, `max_tokens` and
        `max_model_len` leave room for), and `update_from_output` keeps the accepted ones.

    Raises:
      ValueError: the manager's per-request table caps cannot cover max_model_len.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: Iterable[int] | int | None = (),
        prefix_cache: PrefixCache | None = None,
        policy: DeviceResidentPolicy | None = None,
        drafts=None,
    ):
        self.config = config
        self.kv = kv_cache_manager
        self.prefix_cache = prefix_cache
        self.policy = policy if policy is not None else DeviceResidentPolicy(kv_cache_manager)
        self.drafts = drafts
        # P/D (`serving/pd/__init__.py`, `SchedulerConnector`): told when a request finishes and when
        # a request with pulled KV got its pages; holds pages for decode engines. None: no P/D.
        self.kv_connector = None
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        cap = self.kv.max_tokens_per_request()
        if cap is not None and cap < config.max_model_len - 1:
            raise ValueError(
                f"block-table caps cover {cap} tokens per request, max_model_len "
                f"{config.max_model_len} needs {config.max_model_len - 1}"
            )
        # A request with T tokens needs KV for T positions; beyond this length the whole pool
        # (or what the policy can hold, e.g. HiSparse's host pool) could not hold it, so such a
        # request is finished with "length".
        capacity = self.policy.token_capacity()
        self._len_limit = min(config.max_model_len,
                              (self._pool_token_capacity() if capacity is None else capacity) + 1)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_rows: list[int] = list(range(config.max_num_seqs))
        heapq.heapify(self._free_rows)
        self._finished_since_step: list[str] = []
        self.num_preemptions_total = 0
        # Asynchronous scheduling (serving/async_scheduling.py): `schedule()` runs while the
        # previous step is still on the device; `mark_in_flight` advances the scheduled requests
        # when their step is dispatched and `update_from_output` only appends the tokens.
        self.async_scheduling = False

    # ------------------------------------------------------------------ counters

    @property
    def num_requests_running(self) -> int:
        """Requests in the running batch."""
        return len(self.running)

    @property
    def num_requests_waiting(self) -> int:
        """Requests in the waiting queue (new and preempted)."""
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's non-null pages in use, in [0, 1]."""
        return self.kv.pool.usage()

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING) at the back of the waiting queue.

        Raises:
          ValueError: duplicate id, empty prompt, prompt of max_model_len tokens or more, a prompt
            the whole pool could not hold, invalid sampling params, or a request that is not new.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.check_request(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """The checks of `add_request` that do not depend on the live requests (raises the same
        ValueErrors): a decode engine runs them before pulling a request's KV."""
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not a new request")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt must contain at least one token")
        n = request.num_tokens
        if n >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate (max_model_len "
                f"{self.config.max_model_len})"
            )
        if n >= self._len_limit:
            raise ValueError(
                f"prompt of {n} tokens does not fit the KV cache ({self.kv.pool.num_usable_blocks} "
                f"pages in all){self.policy.capacity_note()}"
            )
        request.sampling_params.validate()

    def get_request(self, request_id: str) -> Request | None:
        """The live (waiting or running) request with this id, or None."""
        return self.requests.get(request_id)

    def abort(self, request_id: str, finished_reason: str = "abort") -> RequestOutput | None:
        """Remove a waiting or running request, freeing its pages and state row.

        finished_reason: "abort", "stop" when the front end ended the request because its
            output matched a stop string (the engine does not see stop strings), or "error"
            when the engine step that ran it failed.

        Returns its final RequestOutput (with that finish_reason), or None when the id is
        unknown or already finished.

        Raises:
          ValueError: another finished_reason.
        """
        status = _ABORT_STATUS.get(finished_reason)
        if status is None:
            raise ValueError(f"finished_reason must be one of {sorted(_ABORT_STATUS)}, got {finished_reason!r}")
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, status)
        return self._output(req, [])

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        """Build the next step (see the module docstring). Never schedules more than
        max_num_batched_tokens tokens or more than max_num_seqs requests."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        self.policy.begin_step(self.running, self.waiting)
        max_spec = self.drafts.num_drafts(len(self.running)) if self.drafts is not None else 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            if num_new == 0 or self._ends_in_flight(req):
                i += 1
                continue
            num_known = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
            if num_new == num_known == 1:
                num_new = min(budget, 1 + self._num_spec(req, max_spec))
            num_new = self.policy.cap_new_tokens(req, num_new)
            # Asynchronous scheduling under MTP: the step in flight may accept up to this many of
            # its drafts, which moves this step's rows as many positions further (on the device).
            # (Positions past the length limit are never needed: the request ends there.)
            ahead = req.max_accepted_in_flight if req.num_output_placeholders else 0
            ahead = max(0, min(ahead, self._len_limit - req.num_computed_tokens - num_new))
            while True:
                granted = self.policy.allocate(req, num_new, [sr.request for sr in scheduled], lookahead=ahead)
                if granted:
                    num_new = granted
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself; everything after it is preempted too
            fed = bool(req.num_output_placeholders and req.num_draft_placeholders)  # asynchronous MTP
            scheduled.append(self._scheduled(req, num_new, first_chunk=False, num_spec=max(0, num_new - num_known),
                                             spec_limit=self._spec_limit(req) if fed else None))
            budget -= num_new
            i += 1

        for req, is_cont in self._admission_order():
            if preempted or budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            hit = None
            remote = req.remote_kv  # P/D: KV pulled from a prefill engine (serving/pd/consumer.py)
            if self.prefix_cache is not None and (remote is None or remote.start > 0):
                hit = self.prefix_cache.lookup(req)  # again: an admission before may have evicted pages
            if remote is not None and remote.start > 0:
                # The pull covers the tokens past this engine's own prefix: the hit must still hold
                # the pages it had when the pull was planned (else prefill here after all).
                hit = self.kv_connector.local_hit(req, hit)
                if hit is None:
                    req.remote_kv = remote = None
                    hit = self.prefix_cache.lookup(req)
            num_hit = hit.num_tokens if hit is not None else 0
            if remote is not None:
                num_hit = remote.start + remote.num_tokens
            if remote is not None and hit is None:  # P/D: device pages, or host blocks by pressure (HiSparse)
                num_new, remote.host_pages = self.policy.admit_remote(
                    req, self._cap(req.num_tokens - num_hit, budget), [sr.request for sr in scheduled])
            elif remote is not None:  # P/D after a local prefix hit: its pages plus device pages
                num_new = self.policy.admit(req, hit, self._cap(req.num_tokens - num_hit, budget),
                                            [sr.request for sr in scheduled])
            else:
                num_new = self.policy.admit(req, hit, self._cap(req.num_tokens - num_hit, budget),
                                            [sr.request for sr in scheduled])
            if num_new == 0:
                if is_cont:
                    continue  # the next continuation may fit
                break  # first come, first served among the others
            if hit is not None and not wants_prompt_logprobs(req):  # (it did not read the cache)
                self.prefix_cache.record_query(req.num_tokens, hit)
                if hit.loads:
                    self.prefix_cache.adopt_loads(hit)
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            if remote is not None:
                self.kv_connector.update_state_after_alloc(req, hit)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.state_row = heapq.heappop(self._free_rows)
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new, first_chunk=True))
            budget -= num_new

        out = SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            preempted=preempted,
            finished_ids=self._finished_since_step,
            page_copies=self.kv.take_page_copies(),
            page_loads=self.kv.take_page_loads(),
            num_draft_steps=max_spec,
        )
        self._finished_since_step = []
        self.policy.end_step(out)
        return out

    def mark_in_flight(self, sched_out: SchedulerOutput, exclude: set[str] | frozenset = frozenset()) -> None:
        """Asynchronous scheduling: `sched_out`'s step was dispatched. Every scheduled request
        counts its chunk as computed now, and a sampling one gets an output placeholder (the
        token the step samples, fed to its next step on the device); `update_from_output` of
        that step replaces the placeholder with the token.

        exclude: requests whose chunk may come back shorter (a HiSparse chunk cut at its first
        dropped selection): they are not advanced, and `update_from_output` of this step applies
        their chunk as synchronous scheduling does; the engine reads this step back before it
        schedules again. Rows fed from the step in flight (asynchronous MTP) cannot be excluded
        (RuntimeError): HiSparse never needs it (`HiSparsePolicy.may_truncate`)."""
        fed = exclude and [sr.request_id for sr in sched_out.scheduled if sr.spec_limit is not None and sr.request_id in exclude]
        if fed:  # (its restart position would be off by the accepted count the host does not know yet)
            raise RuntimeError(f"the fed MTP rows of {fed} cannot be a chunk that comes back shorter")
        sched_out.not_marked_in_flight = frozenset(exclude)
        num_drafts = self._drafts_proposed(sched_out)
        for sr in sched_out.scheduled:
            req = sr.request
            if req.status is not RequestStatus.RUNNING or req.request_id in sched_out.not_marked_in_flight:
                continue
            # (MTP: the verified drafts count once the step says how many it accepted)
            req.num_computed_tokens = sr.start_pos + sr.num_new_tokens - sr.num_spec_tokens
            if sr.sample:
                req.num_output_placeholders += 1
                if num_drafts:  # its drafts stay on the device for the next step
                    req.num_draft_placeholders = num_drafts
                    req.max_accepted_in_flight = sr.num_spec_tokens
                    req.spec_token_ids = []

    def _drafts_proposed(self, sched_out: SchedulerOutput) -> int:
        """Drafts per sampling request that the step `sched_out` proposes (MTP speculation: 1 … k,
        as the runner reads them back), 0 without speculation."""
        if self.drafts is None:
            return 0
        return max(1, min(self.drafts.k, sched_out.num_draft_steps))

    def _ends_in_flight(self, req: Request) -> bool:
        """Asynchronous scheduling: True when the tokens still being sampled for `req` finish it
        whatever they are (`max_tokens` or the length limit reached), so no further step is
        scheduled for it."""
        p = req.num_output_placeholders
        if not p:
            return False
        mt = req.sampling_params.max_tokens
        return (mt is not None and req.num_output_tokens + p >= mt) or req.num_tokens + p >= self._len_limit

    def update_from_output(
        self, sched_out: SchedulerOutput, sampled: dict[str, list[int]],
        drafts: dict[str, list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Apply a step's results.

        For every scheduled request still running: advance num_computed_tokens by its chunk,
        append the tokens in `sampled[request_id]` if the chunk had `sample` set, and stop at the
        first token that ends the request: an EOS id (unless ignore_eos) or a stop_token_id ->
        "stop" (the token is kept in the output); max_tokens generated or max_model_len reached
        -> "length". "stop" wins when both apply to the same token. Finished requests release
        their pages and state rows. Requests aborted since `schedule()` are skipped.

        Speculative decoding: a request verified with n drafts gets `sampled` = its a accepted
        drafts and one more token (a + 1 tokens); its KV stays valid for the decode token and the
        accepted drafts only, so num_computed_tokens advances by 1 + a and the rejected drafts'
        slots are written again by the next step (rollback). `drafts[request_id]` become its
        `spec_token_ids` for the next step.

        Returns one RequestOutput per request that produced tokens or finished, in batch order.

        Raises:
          ValueError: tokens given for a request whose chunk does not sample; nothing is applied.
        """
        sampling = {sr.request_id for sr in sched_out.scheduled if sr.sample}
        for rid, tokens in sampled.items():
            if len(tokens) and rid not in sampling:
                raise ValueError(f"tokens sampled for {rid!r}, whose chunk does not sample")

        outputs: list[RequestOutput] = []
        for sr in sched_out.scheduled:
            req = sr.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted since schedule()
            tokens = sampled.get(req.request_id, []) if sr.sample else []
            if self.async_scheduling and req.request_id not in sched_out.not_marked_in_flight:
                # the chunk was counted when its step was dispatched (`mark_in_flight`)
                if sr.sample:
                    req.num_output_placeholders -= 1
            else:
                req.num_computed_tokens = sr.start_pos + sr.num_new_tokens - sr.num_spec_tokens
            if sr.num_spec_tokens:
                req.num_computed_tokens += min(sr.num_spec_tokens, max(0, len(tokens) - 1))
            if req.num_output_placeholders:
                pass  # asynchronous MTP: a step in flight verifies the drafts it was fed on the device
            else:
                req.spec_token_ids = list(drafts.get(req.request_id, ())) if drafts is not None and sr.sample else []
                req.num_draft_placeholders = req.max_accepted_in_flight = 0
            new_tokens: list[int] = []
            status = None
            for token in tokens:
                token = int(token)
                req.append_output_token_ids(token)
                new_tokens.append(token)
                status = self._stop_status(req, token)
                if status is not None:
                    break
            if self.prefix_cache is not None:
                self.prefix_cache.cache_computed_units(req)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            if new_tokens or status is not None:
                outputs.append(self._output(req, new_tokens))
        self.policy.after_update(sched_out)
        return outputs

    # ------------------------------------------------------------------ checks

    def audit(self) -> list[str]:
        """Check the scheduler and the KV cache manager; returns one string per violation.

        Checked: `kv.audit()`; waiting/running are disjoint and hold exactly the live requests,
        with matching statuses; at most max_num_seqs run; running requests own unique state rows
        that, with the free rows, partition range(max_num_seqs), and waiting ones own none; a
        running request's tables cover its num_computed_tokens; only running requests hold
        tables (so finished and preempted requests hold nothing).
        """
        refs = dict(self.policy.external_refs())
        if self.kv_connector is not None:
            for b, n in self.kv_connector.external_refs().items():
                refs[b] = refs.get(b, 0) + n
        errors = list(self.kv.audit(refs))
        errors += self.policy.audit()
        if self.prefix_cache is not None:
            errors += self.prefix_cache.audit()
        cfg = self.config
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        if len(set(running_ids)) != len(running_ids):
            errors.append("a request is running twice")
        if len(set(waiting_ids)) != len(waiting_ids):
            errors.append("a request is waiting twice")
        both = set(running_ids) & set(waiting_ids)
        if both:
            errors.append(f"requests both running and waiting: {sorted(both)}")
        if set(running_ids) | set(waiting_ids) != set(self.requests):
            errors.append("live request table disagrees with the waiting and running queues")
        if len(self.running) > cfg.max_num_seqs:
            errors.append(f"{len(self.running)} running > max_num_seqs {cfg.max_num_seqs}")
        rows: list[int] = []
        for req in self.running:
            if req.status is not RequestStatus.RUNNING:
                errors.append(f"running request {req.request_id!r} has status {req.status.name}")
            if req.state_row is None:
                errors.append(f"running request {req.request_id!r} has no state row")
            else:
                rows.append(req.state_row)
            if not 0 <= req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders:
                errors.append(
                    f"request {req.request_id!r}: num_computed_tokens {req.num_computed_tokens} "
                    f"outside [0, {req.num_tokens + req.num_output_placeholders}]"
                )
            if self.kv.num_slots(req.request_id) < req.num_computed_tokens:
                errors.append(
                    f"request {req.request_id!r}: tables cover {self.kv.num_slots(req.request_id)} "
                    f"tokens < {req.num_computed_tokens} computed"
                )
        for req in self.waiting:
            if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                errors.append(f"waiting request {req.request_id!r} has status {req.status.name}")
            if req.state_row is not None:
                errors.append(f"waiting request {req.request_id!r} holds state row {req.state_row}")
            if req.num_computed_tokens != 0:
                errors.append(f"waiting request {req.request_id!r} has computed tokens")
        if len(set(rows)) != len(rows):
            errors.append(f"state rows not unique: {sorted(rows)}")
        if sorted(rows + self._free_rows) != list(range(cfg.max_num_seqs)):
            errors.append("state rows in use and free rows do not partition range(max_num_seqs)")
        stray = set(self.kv.request_ids()) - set(running_ids)
        if stray:
            errors.append(f"requests that are not running hold KV pages: {sorted(stray)}")
        return errors

    # ------------------------------------------------------------------ helpers

    def _admission_order(self):
        """(request, is continuation) pairs in the order admission tries them: the waiting queue
        (FCFS), or — with the policy's `admission_lookahead` L and prefix caching — the first L + 1
        waiting requests with the continuations (prefix-cache hit ≥ half their tokens) first."""
        lookahead = self.policy.admission_lookahead if self.prefix_cache is not None else 0
        if not lookahead:
            return [(r, False) for r in list(self.waiting)]
        window = list(self.waiting)[: lookahead + 1]
        cont = [2 * self.prefix_cache.lookup(r).num_tokens >= r.num_tokens for r in window]
        return ([(r, True) for r, c in zip(window, cont) if c]
                + [(r, False) for r, c in zip(window, cont) if not c])

    def _num_spec(self, req: Request, max_spec: int) -> int:
        """Drafts a decoding request may verify this step: its `spec_token_ids`, at most `max_spec`,
        leaving room for the extra token under `max_tokens` and the KV under the length limit."""
        # (asynchronous: the drafts of the step in flight, fed on the device)
        available = req.num_draft_placeholders if req.num_output_placeholders else len(req.spec_token_ids)
        return max(0, min(available, max_spec, self._spec_limit(req)))

    def _spec_limit(self, req: Request) -> int:
        """Drafts the length limit and `max_tokens` leave room for after `req`'s tokens (with a
        step in flight: as if it accepted none of its drafts; the device takes the accepted ones
        off, `ScheduledRequest.spec_limit`)."""
        n = self._len_limit - 1 - req.num_tokens - req.num_output_placeholders
        mt = req.sampling_params.max_tokens
        if mt is not None:
            n = min(n, mt - req.num_output_tokens - req.num_output_placeholders - 1)
        return n

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        return self._cap(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)

    def _cap(self, num_new: int, budget: int) -> int:
        """`num_new` tokens capped by long_prefill_token_threshold and the step's budget."""
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _scheduled(self, req: Request, num_new: int, first_chunk: bool, num_spec: int = 0,
                   spec_limit: int | None = None) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request=req,
            num_new_tokens=num_new,
            start_pos=start,
            sample=start + num_new - num_spec >= req.num_tokens + req.num_output_placeholders,
            first_chunk=first_chunk,
            num_spec_tokens=num_spec,
            spec_limit=spec_limit,
        )

    def _preempt(self, req: Request) -> None:
        self.policy.free(req, preempted=True)
        self._release_row(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # a step in flight samples for it: that token is dropped
        req.num_draft_placeholders = req.max_accepted_in_flight = 0
        req.num_published_units = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and release everything; the caller removed it from its queue."""
        req.status = status
        if self.kv_connector is not None:
            self.kv_connector.request_finished(req)
        self.policy.free(req)
        self._release_row(req)
        del self.requests[req.request_id]
        self._finished_since_step.append(req.request_id)

    def _release_row(self, req: Request) -> None:
        if req.state_row is not None:
            heapq.heappush(self._free_rows, req.state_row)
            req.state_row = None

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        is_eos = not params.ignore_eos and token in self.eos_token_ids
        # (before min_tokens the sampler cannot draw these ids, `serving.min_tokens`; a grammar
        # that allows nothing else keeps them, and then they do not end the request early either)
        if (is_eos or token in params.stop_token_ids) and req.num_output_tokens > params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= self._len_limit:
            return RequestStatus.FINISHED_LENGTH
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def max_request_tokens(self) -> int:
        """Most tokens (prompt + output) one request may reach: `max_model_len`, or fewer when the
        KV cache cannot hold that many for one request (the policy's `token_capacity` + 1, e.g.
        Hybrid HiSparse's bound; the last sampled token needs no KV). A request reaching it finishes
        with "length"; the engine refuses one whose prompt + `max_tokens` exceeds it."""
        return self._len_limit

    def _pool_token_capacity(self) -> int:
        """Largest token count one request's KV can reach when it has the whole pool."""
        usable = self.kv.pool.num_usable_blocks
        inv = sum(1.0 / g.tokens_per_page for g in self.kv.groups)
        hi = int(usable / inv) + max(g.tokens_per_page for g in self.kv.groups)
        lo = 0
        while lo < hi:  # largest L with sum_g ceil(L / tpp_g) <= usable
            mid = (lo + hi + 1) // 2
            if sum(math.ceil(mid / g.tokens_per_page) for g in self.kv.groups) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def _output(req: Request, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            kv_transfer_params=req.kv_transfer_params_out if req.is_finished else None,
        )
