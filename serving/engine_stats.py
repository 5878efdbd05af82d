"""The engine's per-step statistics: time to first token, inter-token times and finished requests'
records, prefix-cache and offload counters as per-step deltas, logprobs attached to outputs, MTP
speculation counters, each step's `StepRecord` handed to the stat loggers (Prometheus, the
periodic log line; `serving/metrics.py`). `EngineStatsMixin` is mixed into `serving.engine.LLMEngine`
(and so `DataParallelEngine`), which provides `runner`, `drafts`, `spec_stats`, `prefix_cache`,
`offload`, `stat_loggers` and the counters' last values.
"""

from __future__ import annotations

import logging
import time

from serving.metrics import FinishedRequestStats, StepRecord
from serving.prompt_logprobs import take_prompt_logprobs
from serving.request import Request
from serving.spec_decode import SpecDecodingStats
from serving.types import RequestOutput

logger = logging.getLogger("serving.engine")


class EngineStatsMixin:
    """Step statistics and output decorations of the engine (module docstring)."""

    @property
    def _prompt_logprob_requests(self) -> dict[str, Request]:
        """Requests with `prompt_logprobs` whose first token has not been output yet, by id."""
        d = self.__dict__.get("_prompt_lp_pending")
        if d is None:
            d = self.__dict__["_prompt_lp_pending"] = {}
        return d

    def _track_prompt_logprobs(self, req: Request | None) -> None:
        """Keep a queued request that asked for prompt logprobs until its first output."""
        if req is not None and req.sampling_params.prompt_logprobs is not None:
            self._prompt_logprob_requests[req.request_id] = req

    def _attach_logprobs(self, outs: list[RequestOutput]) -> None:
        """Give each output the `TokenLogprobs` of its new tokens from the step just read
        (`ModelRunner.last_logprobs`; only requests that asked for logprobs have them), and a
        request's first output with a token its prompt logprobs (`serving.prompt_logprobs`)."""
        lps = self.runner.last_logprobs
        pending = self._prompt_logprob_requests
        for out in outs:
            lp = lps.get(out.request_id)
            if lp is not None and out.new_token_ids:
                out.new_logprobs = lp[: len(out.new_token_ids)]
            req = pending.get(out.request_id) if pending else None
            if req is not None and (out.new_token_ids or out.finished):
                del pending[out.request_id]
                if out.new_token_ids:
                    out.prompt_logprobs = take_prompt_logprobs(req)

    def _observe_drafts(self, *scheds, verified: dict | None = None, live: set | None = None) -> SpecDecodingStats | None:
        """MTP speculation: count the step's verifications (drafts verified, accepted) into the
        totals and the draft controller; → the step's counters (None without speculation).
        scheds: the step's `SchedulerOutput`s (one per data-parallel replica). verified: request
        id → drafts really verified where fewer than scheduled (asynchronous scheduling's fed
        requests, `InFlightStep.num_verified`). live: the ids whose step was applied (None: all);
        the others' rows were computed after they stopped (asynchronous scheduling) and dropped."""
        if self.drafts is None:
            return None
        acc = self.runner.last_accepted
        step = SpecDecodingStats(self.drafts.k)
        observed = []
        for sr in (sr for sched in scheds for sr in sched.scheduled):
            if live is not None and sr.request_id not in live:
                continue
            n = sr.num_spec_tokens if verified is None else verified.get(sr.request_id, sr.num_spec_tokens)
            if n and sr.request_id in acc:
                step.observe(n, acc[sr.request_id])
                observed.append((n, acc[sr.request_id]))
        self.spec_stats.add(step)
        self.drafts.observe(observed)
        return step

    def _timing(self, sched, outs: list[RequestOutput], rec: StepRecord) -> None:
        now = time.monotonic()
        reqs = {sr.request_id: sr.request for sr in sched.scheduled}
        for out in outs:
            req = reqs.get(out.request_id)
            n = len(out.new_token_ids)
            if req is None:
                continue
            rec.num_generation_tokens += n
            if n:
                if req.first_token_time is None:
                    req.first_token_time = now
                    rec.num_prompt_tokens += req.num_prompt_tokens
                    rec.ttft_s.append(now - req.arrival_time)
                    n -= 1
                if n and req.last_token_time is not None:
                    rec.inter_token_s.extend([(now - req.last_token_time) / n] * n)
                req.last_token_time = now
            if out.finished:
                rec.finished.append(self._finished_stats(req, now))

    @staticmethod
    def _finished_stats(req: Request, now: float) -> FinishedRequestStats:
        tpot = None
        if req.first_token_time is not None and req.num_output_tokens > 1:
            tpot = ((req.last_token_time or now) - req.first_token_time) / (req.num_output_tokens - 1)
        return FinishedRequestStats(req.finish_reason or "abort", now - req.arrival_time, req.num_prompt_tokens,
                                    req.num_output_tokens, tpot)

    def _prefix_cache_totals(self) -> tuple[int, int]:
        """(queried, hit) prompt tokens of the prefix cache since start-up."""
        return self.prefix_cache.queries, self.prefix_cache.hits

    def _external_prefix_totals(self) -> tuple[int, int]:
        """(queried, hit) prompt tokens with the offloading connector on, since start-up (vLLM's
        external prefix cache counters)."""
        return self.prefix_cache.external_queries, self.prefix_cache.external_hits

    def _emit(self, rec: StepRecord) -> None:
        if self.prefix_cache is not None:
            q, h = self._prefix_cache_totals()
            rec.prefix_cache_queries, rec.prefix_cache_hits = q - self._prefix_counts[0], h - self._prefix_counts[1]
            self._prefix_counts = (q, h)
        if self.offload is not None:
            now = (*self._external_prefix_totals(), *self.offload.totals())
            d = [a - b for a, b in zip(now, self._offload_counts)]
            rec.external_prefix_cache_queries, rec.external_prefix_cache_hits = d[0], d[1]
            page_bytes = self.offload.store.page_bytes
            rec.kv_offload_to_host_bytes, rec.kv_offload_to_device_bytes = d[2] * page_bytes, d[3] * page_bytes
            rec.kv_offload_stores_skipped = d[4]
            self._offload_counts = now
        self._structured_record(rec)
        for sl in self.stat_loggers:
            try:
                sl.record(rec)
            except Exception:  # noqa: BLE001 - statistics must never stop the engine
                logger.exception("stat logger %r failed", sl)
