"""Engine statistics: per-step records, Prometheus metrics with vLLM's names, a periodic log line.

The engine builds one `StepRecord` per step (and one per abort) and hands it to every stat
logger it has (`LLMEngine.stat_loggers`). Two loggers exist:

* `PrometheusStatLogger`: the metrics of docs/design.md §6.2 under vLLM's names, labelled with
  `model_name`, in its own `CollectorRegistry` (so many apps can live in one process, as in the
  tests); serve them with `render()` (Prometheus text format). Gauges are read live from the
  engine at scrape time.
* `LoggingStatLogger`: every `interval_s` seconds, one INFO line with prompt and generation
  throughput, running/waiting requests, KV cache usage, prefix-cache hit rate, preemptions and
  the mean per-step host overhead (host time the device step did not hide: all host work with
  synchronous scheduling, the exposed part with `--async-scheduling`); with HiSparse also the
  hot-buffer hit rate, host → device bytes, residency counts and host-pool usage.

HiSparse metrics (registered only when the engine runs HiSparse): counters
`vllm:hisparse_cache_hits`, `vllm:hisparse_cache_misses`, `vllm:hisparse_host_to_device_bytes`,
`vllm:hisparse_prefill_rows_recomputed`, `vllm:hisparse_pages_released`,
`vllm:hisparse_shared_pages_released`, `vllm:hisparse_requests_revived`,
`vllm:hisparse_squeezed_lease_steps`
(exposed with prometheus_client's `_total` suffix), gauges `vllm:hisparse_requests{state}` and
`vllm:hisparse_host_pool_usage_perc`.

MTP speculation metrics (registered only with `--speculative-config`), vLLM's names: counters
`vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
`vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_accepted_tokens_per_pos{position}`
(each exposed with the `_total` suffix); the log line adds the mean acceptance length
`1 + accepted / drafts` and the per-position acceptance rates of its window.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

logger = logging.getLogger(__name__)

# Bucket edges in seconds / tokens (log-spaced; wide enough for CPU runs and large models).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_HOST_BUCKETS = (0.0, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
_OFFLOAD_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)  # vLLM's kv_offload_size


@dataclass
class FinishedRequestStats:
    """One finished request: reason ("stop", "length", "abort"), end-to-end latency (s, from
    arrival), token counts, and its decode time per output token (s; None below 2 tokens)."""

    finish_reason: str
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    time_per_output_token_s: float | None = None


@dataclass
class StepRecord:
    """What one engine step (or an abort) changed.

    num_prompt_tokens: prompt lengths of the requests that produced their first token.
    num_generation_tokens: tokens generated. num_preemptions: requests preempted.
    prefix_cache_queries / prefix_cache_hits: tokens looked up / found in the prefix cache.
    ttft_s: time to first token of requests that produced it (s). inter_token_s: one entry per
    later token (s since the request's previous token, spread evenly over tokens that arrived
    together). finished: the requests that ended.
    num_scheduled_tokens / host_s / device_s: step size, its exposed host time (host work the
    device did not overlap: all of it with synchronous scheduling, an upper bound of the device's
    idle time with asynchronous scheduling, `serving/async_scheduling.py`) and its device time
    (the wait for its outputs) (s); 0 for an abort record.
    hisparse_hits / hisparse_misses / hisparse_h2d_bytes: HiSparse hot-buffer lookups found hot,
    rows copied from the host pool, and the bytes those copies moved (0 without HiSparse).
    hisparse_recomputed_rows: query rows of truncated HiSparse prefill chunks, computed again.
    external_prefix_cache_queries / external_prefix_cache_hits: tokens looked up with the
    offloading connector on / hit tokens from its host store (vLLM's external prefix cache).
    kv_offload_to_host_bytes / kv_offload_to_device_bytes: the connector's stores and loads.
    kv_offload_stores_skipped: full pages the connector did not store (its host store had no
    free block: every block filed, queued, in flight or pinned).
    spec_decoding: the step's verifications (`serving.spec_decode.SpecDecodingStats`), or None.
    structured_output_requests: constrained requests accepted since the previous record.
    structured_output_mask_s: host time computing the step's token bitmasks (s), None when the
    step ran no constrained row (`serving.structured_outputs`).
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    ttft_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    host_s: float = 0.0
    device_s: float = 0.0
    is_step: bool = True
    hisparse_hits: int = 0
    hisparse_misses: int = 0
    hisparse_h2d_bytes: int = 0
    hisparse_recomputed_rows: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_to_host_bytes: int = 0
    kv_offload_to_device_bytes: int = 0
    kv_offload_stores_skipped: int = 0
    spec_decoding: object = None  # serving.spec_decode.SpecDecodingStats of the step (MTP speculation)
    structured_output_requests: int = 0
    structured_output_mask_s: float | None = None


@dataclass(frozen=True)
class EngineGauges:
    """Live engine state read at scrape/log time: callables returning the current values."""

    num_requests_running: Callable[[], float]
    num_requests_waiting: Callable[[], float]
    kv_cache_usage: Callable[[], float]
    hisparse: object = None  # serving.hisparse.HiSparseGauges when HiSparse is on
    offload: Callable[[], float] | None = None  # the connector's host-store usage when it is on
    num_speculative_tokens: int = 0  # k of MTP speculation (0: off)
    kv_events: object = None  # serving.kv_events.KVEvents when --kv-events-config is on
    dp_placements: object = None  # serving.dp_engine.PlacementStats under data parallelism


class _CounterCollector:
    """Counters read at scrape time: `rows()` → (name, help, value) triples, labelled `model_name`."""

    def __init__(self, rows, model_name: str):
        self.rows = rows
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        for name, doc, value in self.rows():
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], value)
            yield fam


def _kv_events_rows(ev):
    """The KV event publishers' totals (`serving.kv_events.KVEvents`)."""
    return lambda: (
        ("vllm:kv_events_published", "KV event batches sent on the publishers' sockets.", ev.num_published),
        ("vllm:kv_events_dropped", "KV event batches dropped (publisher queue full).", ev.num_dropped),
        ("vllm:kv_event_blocks_stored", "Blocks announced as stored (per medium; one block = one "
         "prefix-cache unit).", ev.num_blocks_stored),
        ("vllm:kv_event_blocks_removed", "Blocks announced as removed.", ev.num_blocks_removed))


_HISPARSE_POLICY_DOCS = {  # `HiSparseGauges.policy_totals` key → help text
    "pages_released": "MLA pages a running request released to the host pool (their one holder).",
    "shared_pages_released": "MLA pages several running requests shared, released by all of them together.",
    "requests_revived": "Requests that took their released pages back once the pressure was gone.",
    "squeezed_lease_steps": ("Request steps run on a hot lease squeezed to one top-k of rows per query row "
                             "(instead of a preemption; docs/hisparse.md \"Squeezed leases\")."),
}


def _hisparse_policy_rows(totals):
    """The HiSparse residency policies' totals (`HiSparseGauges.policy_totals`, summed over
    data-parallel replicas)."""
    return lambda: [(f"vllm:hisparse_{k}", _HISPARSE_POLICY_DOCS[k], v) for k, v in totals().items()]


class _PlacementCollector:
    """The data-parallel engine's placements (`serving.dp_engine.PlacementStats`) as counters."""

    def __init__(self, stats, model_name: str):
        self.stats = stats
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        st = self.stats
        placed = CounterMetricFamily("vllm:dp_placements", "Requests placed per data-parallel replica.",
                                     labels=["model_name", "data_parallel_rank"])
        for rank, n in enumerate(st.placed):
            placed.add_metric([self.model_name, str(rank)], n)
        yield placed
        pinned = CounterMetricFamily("vllm:dp_placements_pinned", "Requests a router pinned to a replica "
                                     "(X-data-parallel-rank).", labels=["model_name"])
        pinned.add_metric([self.model_name], st.pinned)
        yield pinned
        hits = CounterMetricFamily("vllm:dp_placement_prefix_hit_tokens", "Prefix-cache hit tokens of the chosen "
                                   "replica when a request was placed (the replica choice's reason).",
                                   labels=["model_name"])
        hits.add_metric([self.model_name], st.prefix_hit_tokens)
        yield hits


class PrometheusStatLogger:
    """vLLM-named Prometheus metrics in a private registry.

    Args:
      model_name: value of the `model_name` label.
      gauges: live engine state (see `EngineGauges`).
      registry: the registry to register in (default: a new one).
    """

    def __init__(self, model_name: str, gauges: EngineGauges, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        lv = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, labels, registry=r).labels(**lv).set_function(fn)

        gauge("vllm:num_requests_running", "Requests in the running batch.", gauges.num_requests_running)
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (new and preempted).",
              gauges.num_requests_waiting)
        gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).", gauges.kv_cache_usage)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=r).labels(**lv)

        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative preemptions (recompute).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache.")
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._model_name = model_name
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name=model_name, finished_reason=reason)

        def hist(name: str, doc: str, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**lv)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (s).", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens (s).",
                        _ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Time per output token (s); same samples "
                         "as inter_token_latency_seconds.", _ITL_BUCKETS)
        self.req_tpot = hist("vllm:request_time_per_output_token_seconds",
                             "Per request: decode time / (output tokens - 1) (s).", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish (s).", _E2E_BUCKETS)
        self.structured_requests = counter("vllm:structured_output_requests",
                                           "Requests with an output constraint (JSON schema, regex, choice, grammar, "
                                           "forced tool call).")
        self.structured_mask = hist("vllm:structured_output_mask_seconds",
                                    "Per engine step with constrained rows: host time computing their token bitmasks "
                                    "(s).", _STEP_HOST_BUCKETS)
        self.exposed_host = hist("vllm:step_exposed_host_seconds",
                                 "Per engine step: host time the device did not overlap (all host work with "
                                 "synchronous scheduling; with --async-scheduling an upper bound of the "
                                 "device's idle time) (s).", _STEP_HOST_BUCKETS)
        self.hisparse = gauges.hisparse is not None
        if self.hisparse:  # Hybrid HiSparse (serving/hisparse)
            hs = gauges.hisparse
            self.hot_hits = counter("vllm:hisparse_cache_hits",
                                    "HiSparse hot-buffer lookups found in the hot buffer (distinct rows per step "
                                    "and IndexShare group; hits + misses = lookups).")
            self.hot_misses = counter("vllm:hisparse_cache_misses",
                                      "HiSparse hot-buffer lookups copied from the host pool.")
            self.hot_bytes = counter("vllm:hisparse_host_to_device_bytes",
                                     "Bytes moved from the HiSparse host pool to the device for hot-buffer rows "
                                     "(what crosses the host boundary: the host-callback path moves whole "
                                     "chunks, padding included).")
            self.hot_recomputed = counter("vllm:hisparse_prefill_rows_recomputed",
                                          "Query rows of adaptively sized HiSparse prefill chunks computed again "
                                          "because the chunk overflowed its hot lease and was truncated.")
            states = Gauge("vllm:hisparse_requests", "Running requests per HiSparse residency state "
                           "(full: all pages on the device; mixed: some only in the host pool; none: "
                           "no page before the tail on the device).", labels + ["state"], registry=r)
            for st in ("full", "mixed", "none"):
                states.labels(model_name=model_name, state=st).set_function(
                    lambda st=st: hs.residency().get(st, 0))
            gauge("vllm:hisparse_host_pool_usage_perc", "Fraction of HiSparse host-pool blocks in use (1 = full).",
                  hs.host_pool_usage)
            if hs.policy_totals is not None:
                r.register(_CounterCollector(_hisparse_policy_rows(hs.policy_totals), model_name))
        self.offload = gauges.offload is not None
        if self.offload:  # the KV offloading connector (serving/offload), vLLM's names
            self.ext_queries = counter("vllm:external_prefix_cache_queries",
                                       "Tokens looked up with the KV offloading connector on.")
            self.ext_hits = counter("vllm:external_prefix_cache_hits",
                                    "Prompt tokens whose KV came back from the connector's host store.")
            kind = labels + ["transfer_type"]
            off_bytes = Counter("vllm:kv_offload_total_bytes", "Bytes moved by the KV offloading connector.",
                                kind, registry=r)
            off_size = Histogram("vllm:kv_offload_size", "KV offloading transfer size per step (bytes).", kind,
                                 buckets=_OFFLOAD_BUCKETS, registry=r)
            self.off_bytes = {t: off_bytes.labels(model_name=model_name, transfer_type=t)
                              for t in ("gpu_to_cpu", "cpu_to_gpu")}
            self.off_size = {t: off_size.labels(model_name=model_name, transfer_type=t)
                             for t in ("gpu_to_cpu", "cpu_to_gpu")}
            self.off_skipped = counter("vllm:kv_offload_stores_skipped", "Full pages the KV offloading connector "
                                       "did not store because its host store had no free block (raise "
                                       "cpu_bytes_to_use when this grows).")
            gauge("vllm:kv_offload_host_usage_perc", "Fraction of the connector's host-store blocks filed, queued or "
                  "pinned (1 = full).", gauges.offload)
        if gauges.kv_events is not None:  # KV events (serving/kv_events)
            r.register(_CounterCollector(_kv_events_rows(gauges.kv_events), model_name))
        if gauges.dp_placements is not None:  # the data-parallel engine's replica choice
            r.register(_PlacementCollector(gauges.dp_placements, model_name))
        self.spec_k = gauges.num_speculative_tokens
        if self.spec_k:  # MTP speculation (serving/spec_decode), vLLM's names
            self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Draft verifications (one per request per "
                                       "step that verified drafts).")
            self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
            self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted per draft "
                              "position (0-based).", labels + ["position"], registry=r)
            self.spec_per_pos = [per_pos.labels(model_name=model_name, position=str(j)) for j in range(self.spec_k)]
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens per finished request.",
                            _TOKEN_BUCKETS)

    def record(self, rec: StepRecord) -> None:
        """Apply one step's record."""
        if rec.num_preemptions:
            self.num_preemptions.inc(rec.num_preemptions)
        if rec.num_prompt_tokens:
            self.prompt_tokens.inc(rec.num_prompt_tokens)
        if rec.num_generation_tokens:
            self.generation_tokens.inc(rec.num_generation_tokens)
        if rec.prefix_cache_queries:
            self.prefix_queries.inc(rec.prefix_cache_queries)
        if rec.prefix_cache_hits:
            self.prefix_hits.inc(rec.prefix_cache_hits)
        if self.offload:
            self.ext_queries.inc(rec.external_prefix_cache_queries)
            self.ext_hits.inc(rec.external_prefix_cache_hits)
            for t, n in (("gpu_to_cpu", rec.kv_offload_to_host_bytes), ("cpu_to_gpu", rec.kv_offload_to_device_bytes)):
                if n:
                    self.off_bytes[t].inc(n)
                    self.off_size[t].observe(n)
            self.off_skipped.inc(rec.kv_offload_stores_skipped)
        if self.hisparse:
            self.hot_hits.inc(rec.hisparse_hits)
            self.hot_misses.inc(rec.hisparse_misses)
            self.hot_bytes.inc(rec.hisparse_h2d_bytes)
            self.hot_recomputed.inc(rec.hisparse_recomputed_rows)
        sd = rec.spec_decoding
        if self.spec_k and sd is not None and sd.num_drafts:
            self.spec_drafts.inc(sd.num_drafts)
            self.spec_draft_tokens.inc(sd.num_draft_tokens)
            self.spec_accepted.inc(sd.num_accepted_tokens)
            for c, v in zip(self.spec_per_pos, sd.accepted_per_pos):
                if v:
                    c.inc(v)
        if rec.is_step:
            self.exposed_host.observe(rec.host_s)
        if rec.structured_output_requests:
            self.structured_requests.inc(rec.structured_output_requests)
        if rec.structured_output_mask_s is not None:
            self.structured_mask.observe(rec.structured_output_mask_s)
        for v in rec.ttft_s:
            self.ttft.observe(v)
        for v in rec.inter_token_s:
            self.itl.observe(v)
            self.tpot.observe(v)
        for f in rec.finished:
            self._success.labels(model_name=self._model_name, finished_reason=f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency_s)
            self.req_prompt.observe(f.num_prompt_tokens)
            self.req_gen.observe(f.num_generation_tokens)
            if f.time_per_output_token_s is not None:
                self.req_tpot.observe(f.time_per_output_token_s)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)


class LoggingStatLogger:
    """Logs one line of engine statistics every `interval_s` seconds of steps (see the module
    docstring)."""

    def __init__(self, gauges: EngineGauges, interval_s: float = 5.0, log: logging.Logger = logger):
        self.gauges = gauges
        self.interval_s = interval_s
        self.log = log
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._t0 = now
        self._prompt = self._gen = self._steps = self._preempt = self._q = self._h = 0
        self._hot_h = self._hot_m = self._hot_b = 0
        self._ext_q = self._ext_h = self._off_out = self._off_in = 0
        self._host = self._device = 0.0
        self._spec = None

    def record(self, rec: StepRecord) -> None:
        """Accumulate; log and restart the window once `interval_s` has passed."""
        self._prompt += rec.num_prompt_tokens
        self._gen += rec.num_generation_tokens
        self._preempt += rec.num_preemptions
        self._q += rec.prefix_cache_queries
        self._h += rec.prefix_cache_hits
        self._hot_h += rec.hisparse_hits
        self._hot_m += rec.hisparse_misses
        self._hot_b += rec.hisparse_h2d_bytes
        self._ext_q += rec.external_prefix_cache_queries
        self._ext_h += rec.external_prefix_cache_hits
        self._off_out += rec.kv_offload_to_host_bytes
        self._off_in += rec.kv_offload_to_device_bytes
        if rec.spec_decoding is not None:
            if self._spec is None:
                from serving.spec_decode import SpecDecodingStats

                self._spec = SpecDecodingStats(rec.spec_decoding.num_spec_tokens)
            self._spec.add(rec.spec_decoding)
        if rec.is_step:
            self._steps += 1
            self._host += rec.host_s
            self._device += rec.device_s
        now = time.monotonic()
        if now - self._t0 >= self.interval_s:
            self.log.info("%s", self.summary(now))
            self._reset(now)

    def summary(self, now: float | None = None) -> str:
        """The statistics line for the current window."""
        dt = max((now if now is not None else time.monotonic()) - self._t0, 1e-9)
        steps = max(self._steps, 1)
        host_share = self._host / max(self._host + self._device, 1e-12)
        hit_rate = 100.0 * self._h / self._q if self._q else 0.0
        return (f"Avg prompt throughput: {self._prompt / dt:.1f} tokens/s, "
                f"Avg generation throughput: {self._gen / dt:.1f} tokens/s, "
                f"Running: {self.gauges.num_requests_running():.0f} reqs, "
                f"Waiting: {self.gauges.num_requests_waiting():.0f} reqs, "
                f"KV cache usage: {100 * self.gauges.kv_cache_usage():.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%, Preemptions: {self._preempt}, "
                f"Steps: {self._steps}, host overhead {1e3 * self._host / steps:.2f} ms/step "
                f"({100 * host_share:.0f}% of step time), device {1e3 * self._device / steps:.2f} ms/step"
                + self._hisparse_summary(dt) + self._offload_summary(dt) + self._spec_summary())

    def _spec_summary(self) -> str:
        sd = self._spec
        if sd is None:
            return ""
        rate = 100.0 * sd.num_accepted_tokens / sd.num_draft_tokens if sd.num_draft_tokens else 0.0
        per_pos = ", ".join(f"{r:.3f}" for r in sd.per_position_rates())
        return (f", SpecDecoding: mean acceptance length {sd.mean_acceptance_length:.2f}, accepted "
                f"{sd.num_accepted_tokens}/{sd.num_draft_tokens} draft tokens ({rate:.1f}%), per-position "
                f"acceptance [{per_pos}]")

    def _offload_summary(self, dt: float) -> str:
        if self.gauges.offload is None:
            return ""
        rate = 100.0 * self._ext_h / self._ext_q if self._ext_q else 0.0
        return (f", KV offload: external hit rate {rate:.1f}%, to host {self._off_out / 2**20 / dt:.2f} MiB/s, "
                f"to device {self._off_in / 2**20 / dt:.2f} MiB/s, host store {100 * self.gauges.offload():.1f}%")

    def _hisparse_summary(self, dt: float) -> str:
        hs = self.gauges.hisparse
        if hs is None:
            return ""
        lookups = self._hot_h + self._hot_m
        rate = 100.0 * self._hot_h / lookups if lookups else 0.0
        res = hs.residency()
        return (f", HiSparse: hot hit rate {rate:.1f}% ({lookups} lookups), host->device "
                f"{self._hot_b / 2**20 / dt:.2f} MiB/s, residency full/mixed/none "
                f"{res.get('full', 0)}/{res.get('mixed', 0)}/{res.get('none', 0)}, host pool "
                f"{100 * hs.host_pool_usage():.1f}%")
