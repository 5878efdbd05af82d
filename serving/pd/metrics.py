"""P/D metrics, read from the connector at scrape time (a prometheus_client collector).

vLLM's NIXL names where the meaning is the same: `vllm:nixl_xfer_time_seconds` (histogram, one
observation per pulled request: from the decode engine's stage request to the bytes on its
device), `vllm:nixl_bytes_transferred` (histogram, bytes per pulled request),
`vllm:nixl_num_failed_transfers` (counter: pulls that failed or missed kv_load_timeout). Ours:
decode side `vllm:kv_transfer_requests_waiting` (gauge: requests waiting for their KV),
`vllm:kv_transfer_remote_prompt_tokens` (counter: prompt tokens landed from a prefill engine
instead of computed), `vllm:kv_transfer_landed_requests{place}` (counter; place "device" or
"host": the HiSparse host pool);
prefill side `vllm:kv_transfer_held_requests` (gauge: finished requests whose pages wait for a
decode engine), `vllm:kv_transfer_staged_requests` / `vllm:kv_transfer_staged_bytes` (counters),
`vllm:kv_transfer_expired` (counter: holds or stagings dropped after abort_request_timeout).
Counters are exposed with the `_total` suffix.
"""

from __future__ import annotations

import bisect

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BYTE_BUCKETS = (1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11)


class Histogram:
    """Cumulative bucket counts of observations (fixed memory for a long-running server)."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def family(self, name: str, doc: str, model_name: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=["model_name"])
        acc, out = 0, []
        for edge, c in zip(self.buckets + (float("inf"),), self.counts):
            acc += c
            out.append(("+Inf" if edge == float("inf") else repr(float(edge)), acc))
        fam.add_metric([model_name], out, self.sum)
        return fam


class PDCollector:
    """Collector over an engine's `PDConnector` (register it in the server's registry)."""

    def __init__(self, pd, model_name: str):
        self.pd, self.model_name = pd, model_name

    def collect(self):
        m = [self.model_name]
        c, p = self.pd.consumer, self.pd.producer

        def counter(name, doc, value, labels=None, label_values=()):
            fam = CounterMetricFamily(name, doc, labels=["model_name"] + list(labels or []))
            fam.add_metric(m + list(label_values), value)
            return fam

        def gauge(name, doc, value):
            fam = GaugeMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric(m, value)
            return fam

        if c is not None:
            yield c.xfer_time.family("vllm:nixl_xfer_time_seconds", "Seconds from stage request to KV on the "
                                     "device, per pulled request.", self.model_name)
            yield c.xfer_bytes.family("vllm:nixl_bytes_transferred", "Bytes of KV pulled per request.",
                                      self.model_name)
            yield counter("vllm:nixl_num_failed_transfers", "KV pulls that failed or missed kv_load_timeout.",
                          c.num_failed_transfers)
            yield gauge("vllm:kv_transfer_requests_waiting", "Requests waiting for their KV from a prefill engine.",
                        len(c.pending))
            yield counter("vllm:kv_transfer_remote_prompt_tokens", "Prompt tokens landed from a prefill engine "
                          "instead of computed.", c.num_remote_tokens)
            fam = CounterMetricFamily("vllm:kv_transfer_landed_requests", "Requests whose pulled KV landed, by place "
                                      "(device pages, or the HiSparse host pool).", labels=["model_name", "place"])
            fam.add_metric(m + ["device"], c.num_landed_device)
            fam.add_metric(m + ["host"], c.num_landed_host)
            yield fam
        if p is not None:
            yield gauge("vllm:kv_transfer_held_requests", "Finished requests whose pages wait for a decode engine.",
                        len(p.held))
            yield counter("vllm:kv_transfer_staged_requests", "Requests staged for a decode engine's pull.",
                          p.num_staged)
            yield counter("vllm:kv_transfer_staged_bytes", "Bytes staged for decode engines' pulls.", p.bytes_staged)
            yield counter("vllm:kv_transfer_expired", "Holds or stagings dropped after abort_request_timeout.",
                          p.num_expired)
