"""Asynchronous scheduling (`--async-scheduling`): the host schedules and prepares step n+1, and
reads back and applies step n's tokens, while the device runs.

One `LLMEngine.step()` call, with step n in flight:

1. schedule step n+1. A running request that step n samples for carries an *output placeholder*
   (`Request.num_output_placeholders`): it is scheduled for one more token whose value is not
   known on the host yet. A request whose placeholders finish it whatever they are (`max_tokens`,
   the length limit) is not scheduled again.
2. dispatch step n+1 without waiting (`ModelRunner.dispatch`, or `dispatch_replicas` for the
   DP replicas' stacked step). A placeholder row's input id is taken on the device from step n's
   sampled-token array (`serving.runner._feed_tokens`): the row of the request in step n, which
   stays valid because step n's outputs are kept until step n+1 was dispatched (one step in
   flight, no ring to overflow). Under DP a request's rows are its replica's slices of the
   stacked step; under PCP the fed row follows the load-balanced token order the step's tokens
   are placed in (`ModelRunner._feed`). `Scheduler.mark_in_flight` (every replica's) then counts
   step n+1's chunks as computed.
3. wait for step n's outputs (`ModelRunner.finish`) and apply them (`Scheduler.update_from_output`:
   stop rules, tokens appended, finished requests freed), and return them for streaming — while
   step n+1 runs.

A request that stops at step n (EOS, a stop token, a stop string the front end matched) was
already scheduled in step n+1: that one extra token is computed and never streamed (the update of
step n+1 skips finished requests). Aborts and preemptions between the two steps drop the
placeholder's token the same way (a preempted request recomputes it, deterministically).

**The page rule.** Every program that reads or writes the KV arena takes the arena as an argument
and returns it (the step donates it), so the device runs them in dispatch order. A page freed on
the host while step n+1 still writes it (a request finished by step n's update) can only be handed
to a step dispatched later, which runs after step n+1: nothing reads a page an in-flight step
still writes, nor writes one it still reads. DP replicas own disjoint arena shards within the
one donated arena, so the rule holds for each of them as for one engine.

The offloading connector's transfers are in the same chain: its store program reads the arena (a later program that donates the arena waits for that read) and its load program donates
the arena to the step, and with the `memory_kind` mechanism the host store array is threaded
through both. So a store dispatched before step n+1 runs before every load that a later
admission plans from its block, and a load runs before any later store can overwrite its
source: the connector files its stores and releases its loads' source blocks as soon as their
step is dispatched (`_after_dispatch`), not when it finishes. Hybrid HiSparse's write-through
copies likewise: the store program reads the arena and writes the host pool, which the steps
take as an operand (`memory_kind`) or whose completion value they take (`callback`), so its
copies are completed (pages clean, host prefixes published) when they are dispatched; a clean
page released by the next schedule can only be overwritten, and its host rows only read, by
later programs.

**Chunks that may come back shorter.** Under HiSparse a prefill chunk resolved through a hot
lease may be cut at its first dropped selection (`serving.hisparse.truncation`): its request
restarts where the step really ended, which the host learns only from the step's outputs. Such
chunks are not counted at dispatch (`Scheduler.mark_in_flight(exclude=)`, recorded in
`SchedulerOutput.not_marked_in_flight`) and their step is read back in the same `step()` call,
before the next schedule; nothing publishes, seals or offloads their rows before. Steps without
them (decode, plain-program steps) overlap as usual.

P/D transfers are in the chain as well: the prefill side stages a finished request's pages with
a gather program over the current arena (the output of the step in flight, so it waits for it),
and the decode side lands pulled pages with a program that donates the arena to the next step.
A multi-process engine sends each step's inputs to its followers with the feed's source rows
(`StepInputs.feed_src`); every process feeds from its own copy of the previous step's sampled
tokens (`ModelRunner._last_sampled`).

**MTP speculation.** A request that step n verifies is scheduled in step n+1 as if step n accepted
none of its drafts: its rows are the token step n emits and the drafts it proposes, with pages for
the most it may accept (`Request.num_draft_placeholders`, `max_accepted_in_flight`). Before step n+1
runs, the device takes those tokens from step n's outputs and moves the rows, their slots and the
sampler's step counters by the accepted count (`serving.spec_decode.feed`); `update_from_output` of
step n adds the accepted drafts to `num_computed_tokens`. A step after one with rows whose
`min_tokens` is not reached waits for it (the bans depend on the accepted count). Once step n is
read back, the engine works out how many drafts each fed request of step n+1 really verifies
(`InFlightStep.num_verified`). Under Hybrid HiSparse a fed request's hot inputs (host table,
lease, state row) do not depend on its positions, its lease is sized by its rows
(`allocate(lookahead=)` gives the positions the accepted drafts move it by token pages only), and
its verification rows always fit the lease, so their selections are never dropped: they are
counted at dispatch like a decode row (`HiSparsePolicy.may_truncate`; a fed chunk is never one
that may come back shorter, whose restart position would be off by the accepted count —
`Scheduler.mark_in_flight` refuses one).

**Structured outputs.** A constrained request's next mask needs the token the step in flight
samples for it. So after a step with a constrained row, step n+1 is dispatched as its forward pass
alone (its logits stay on the device, `ModelRunner.dispatch(defer_sampling=True)`); step n is read
back and applied, which advances the grammar matchers; the masks of step n+1 are computed and its
sampler runs on the logits (`ModelRunner.sample_deferred`), all while the device runs step n+1's
forward pass. Forward then sampler computes what the one-program step computes. A multi-process
engine (whose followers run whole steps) waits for the step in flight instead. Presence,
frequency and repetition penalties count a request's output tokens, so a step after one with such
a row is deferred the same way (`serving.penalties`); a logit bias alone is not. Under MTP the step cannot be split: the
engine waits for the step in flight instead.

**Exposed host time.** The device idles when step n finished before step n+1 was dispatched.
`LLMEngine.host_overhead_s` and the `host` of the stats line add, per step, the host time between
the end of the previous wait and the next dispatch when the step in flight was already done at
that dispatch (`jax.Array.is_ready`), else 0: an upper bound of the device's idle time.
"""

from __future__ import annotations

import time

from serving.hisparse.truncation import truncate_step
from serving.metrics import StepRecord
from serving.penalties import output_dependent
from serving.request import RequestStatus


def _output_penalties(sched) -> bool:
    """True when a sampled row of `sched` has penalties that count its output (`serving.penalties`):
    the next step's counts need this step's token."""
    return any(sr.sample and output_dependent(sr.request) for sr in sched.scheduled)


def _min_tokens_pending(sched) -> bool:
    """MTP speculation: True when a sampled row of `sched` (the step in flight) has `min_tokens`
    not yet reached by the tokens known to come: the next step's bans (`serving.min_tokens`) depend
    on how many drafts the step in flight accepts."""
    return any(sr.sample and sr.request.sampling_params.min_tokens
               > len(sr.request.output_token_ids) + sr.request.num_output_placeholders for sr in sched.scheduled)


class AsyncStepMixin:
    """`LLMEngine.step` with asynchronous scheduling (see the module docstring). The engine sets
    `self.async_scheduling` (bool) and `self._in_flight` (the `InFlightStep` not read yet), and
    provides `_schedulers()` (its schedulers: one, or one per DP replica, in replica order),
    `_dispatch_step(scheds, prev)` → `InFlightStep`, `_finish_step(step)` → the sampled tokens
    per scheduler (`ModelRunner.dispatch` / `finish`, or their `_replicas` forms) and
    `_after_dispatch()` (host bookkeeping of the transfers dispatched with the step)."""

    _in_flight = None
    _last_wait_end: float | None = None

    def _preemptions(self) -> int:
        return sum(s.num_preemptions_total for s in self._schedulers())

    def _step_async(self):
        pd_outs = self._pd_tick()
        prev = self._in_flight
        preempted_before = self._preemptions()
        defer = False
        if prev is not None and any(self.structured.constrains(s) or _output_penalties(s)
                                    or (self.drafts is not None and _min_tokens_pending(s)) for s in prev.scheds):
            # Structured outputs and output-dependent penalties: the next masks (counts) need the
            # tokens of the step in flight. Dispatch the next forward pass now and its sampler
            # once those tokens are applied (one process, no speculation), else wait for the
            # step in flight first. (Under MTP `min_tokens` bans too: the step in flight's
            # accepted count decides which verification rows are still before `min_tokens`.)
            defer = self.runner.can_defer_sampling
            if not defer:
                pd_outs = pd_outs + self._complete(prev, 0.0, preempted_before)
                self._in_flight = prev = None
                preempted_before = self._preemptions()
        schedulers = self._schedulers()
        scheds = [s.schedule() for s in schedulers]
        exposed = 0.0
        step = None
        if not all(s.is_empty for s in scheds):
            try:
                if not defer:
                    self._structured_masks(scheds)
                self._pd_writes()  # pulled P/D pages land before the step (a program on the arena)
                # The device idled if the step in flight (or none) was done before this dispatch.
                idle = prev is None or prev.out[0].is_ready()
                step = self._dispatch_step(scheds, prev, defer)
                if idle and self._last_wait_end is not None:
                    exposed = step.dispatched - self._last_wait_end
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                outs = self._complete(prev, 0.0, preempted_before) if prev is not None else []
                self._in_flight = None
                return pd_outs + outs + self._fail_step(list(zip(schedulers, scheds)), e)
            uncertain = self._uncertain_chunks(step)
            for scheduler, sched, unsure in zip(schedulers, scheds, uncertain):
                scheduler.mark_in_flight(sched, unsure)
            self._in_flight = step
            self._after_dispatch()
        else:
            self._in_flight = None
            if prev is not None and self._last_wait_end is not None:
                exposed = time.perf_counter() - self._last_wait_end
        outs = pd_outs
        if prev is None:
            self._last_wait_end = None
            self._end_step()
        else:
            outs = outs + self._complete(prev, exposed, preempted_before)
        if step is not None and step.deferred is not None and self._in_flight is step:
            outs = outs + self._sample_deferred(step)
        if self._in_flight is not None and any(self._in_flight.scheds[r].not_marked_in_flight
                                               for r in range(len(schedulers))):
            # A chunk of this step may come back shorter (HiSparse): read it back before the
            # next schedule, which must start that request where this step really ended.
            step, self._in_flight = self._in_flight, None
            outs = outs + self._complete(step, 0.0, self._preemptions())
        return outs

    def _sample_deferred(self, step):
        """The masks of `step` (dispatched without its sampler while a constrained step was in
        flight), from the matchers that step's tokens advanced, and its sampler → [] (or the
        failed requests' outputs when the sampler cannot be dispatched)."""
        try:
            self._structured_masks(step.scheds)
            self.runner.sample_deferred(step)
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
            self._in_flight = None
            return self._fail_step(list(zip(self._schedulers(), step.scheds)), e)
        return []

    def _complete(self, prev, exposed: float, preempted_before: int):
        """Wait for the step `prev`, apply its tokens, emit its statistics → its outputs."""
        schedulers = self._schedulers()
        try:
            sampled = self._finish_step(prev)
        except Exception as e:  # noqa: BLE001
            failed = list(zip(schedulers, prev.scheds))
            if self._in_flight is not None:
                failed += list(zip(schedulers, self._in_flight.scheds))
                self._in_flight = None
            return self._fail_step(failed, e)
        self._last_wait_end = time.perf_counter()
        self._count_verified(self._in_flight)
        scheds, recomputed = self._truncate(prev, sampled)
        drafts = self.runner.last_drafts if self.drafts is not None else None
        # (a request that stopped, or was aborted or preempted, while this step was in flight: its
        # rows were computed and are dropped (`update_from_output` skips it), its verifications too)
        live = {sr.request_id for s in scheds for sr in s.scheduled if sr.request.status is RequestStatus.RUNNING}
        per_scheduler = [sch.update_from_output(sched, toks, drafts) if not sched.is_empty else []
                         for sch, sched, toks in zip(schedulers, scheds, sampled)]
        outs = [o for part in per_scheduler for o in part]
        self._structured_advance(outs)
        spec_step = self._observe_drafts(*scheds, verified=prev.num_verified, live=live)
        self._end_step()
        self._attach_logprobs(outs)
        st = self.runner.last
        self.num_steps += 1
        self.host_overhead_s += exposed
        if self.stat_loggers:
            rec = StepRecord(num_preemptions=self._preemptions() - preempted_before,
                             num_scheduled_tokens=st.num_tokens, host_s=exposed, device_s=st.device_s)
            if self.hisparse is not None and prev.stats is not None:
                rec.hisparse_hits, rec.hisparse_misses, _, rec.hisparse_h2d_bytes = self.hisparse.device.last_stats
                rec.hisparse_recomputed_rows = recomputed
            rec.spec_decoding = spec_step
            for sched, part in zip(scheds, per_scheduler):
                self._timing(sched, part, rec)
            self._emit(rec)
        return outs

    def _count_verified(self, step) -> None:
        """MTP: the drafts each fed request of `step` (dispatched after the step just read back)
        really verifies, now that the accepted counts it was moved by are known
        (`InFlightStep.num_verified`: the verification statistics count these)."""
        if step is None or self.drafts is None:
            return
        accepted = self.runner.last_accepted
        step.num_verified = {sr.request_id: max(0, min(sr.num_spec_tokens, sr.spec_limit - accepted.get(sr.request_id, 0)))
                             for s in step.scheds for sr in s.scheduled if sr.spec_limit is not None}

    def _uncertain_chunks(self, step) -> list[frozenset]:
        """Per scheduler, the requests of the dispatched `step` whose chunk may come back shorter:
        under Hybrid HiSparse, chunks of several query rows resolved through a hot lease in a step
        on the hot program (`HiSparsePolicy.may_truncate`). Also keeps the policies' query rows
        of the step for `observe_step` (`InFlightStep.policy_rows`)."""
        n = len(step.scheds)
        if self.hisparse is None:
            return [frozenset()] * n
        policies = self.hisparse.policies
        step.policy_rows = [p.step_rows() for p in policies]
        if step.stats is None:  # the plain program: nothing is resolved through a lease
            return [frozenset()] * n
        return [frozenset(sr.request_id for sr in sched.scheduled if p.may_truncate(sr.request_id, sr.num_new_tokens))
                for p, sched in zip(policies, step.scheds)]

    def _truncate(self, step, sampled: list) -> tuple[list, int]:
        """Hybrid HiSparse: each scheduler's schedule of the finished `step` with its truncated
        chunks cut (`serving.hisparse.truncation.truncate_step`; `sampled` is updated in place),
        and the adaptive prefill estimate updated (`observe_step`) → (schedules, query rows to
        compute again). A chunk that `mark_in_flight` counted cannot be cut (RuntimeError)."""
        scheds = list(step.scheds)
        if self.hisparse is None:
            return scheds, 0
        truncs = self.runner.last_truncated
        truncs = truncs if isinstance(truncs, list) else [truncs]
        recomputed = 0
        for r, policy in enumerate(self.hisparse.policies):
            scheds[r], sampled[r], kept = truncate_step(scheds[r], sampled[r], truncs[r])
            counted = set(kept) - scheds[r].not_marked_in_flight
            if counted:
                raise RuntimeError(f"chunks of {sorted(counted)} were cut although counted at dispatch")
            rows = step.policy_rows[r] if step.policy_rows is not None else None
            recomputed += policy.observe_step(kept, rows)
        return scheds, recomputed
