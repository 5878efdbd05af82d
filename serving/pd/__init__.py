"""Prefill/decode disaggregation: a prefill engine hands each request's KV to a decode engine.

    # prefill engine, decode engine, router (vllm-router speaks this protocol)
    python -m serving.run --port 8100 --kv-transfer-config '{"kv_connector":"JaxTransferConnector","kv_role":"kv_producer"}'
    python -m serving.run --port 8200 --kv-transfer-config '{"kv_connector":"JaxTransferConnector","kv_role":"kv_consumer"}'
    vllm-router --vllm-pd-disaggregation --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

The pieces (docs/pd.md has the design, the protocol and the numbers):

* `config.py`       — the connector's `--kv-transfer-config` keys (vLLM's NixlConnector spelling).
* `params.py`       — `kv_transfer_params`, the per-request protocol, and its checks (400s).
* `layout.py`       — the KV row-format descriptor both sides must share.
* `relayout.py`     — pages of any DCP size / interleave ↔ layout-free canonical rows (numpy).
* `transfer.py`     — the data plane: `jax.experimental.transfer`, one server per process.
* `side_channel.py` — the control plane: stage / release requests over ZMQ.
* `producer.py`     — prefill side: keep finished requests' pages, stage them on request, deadlines.
* `consumer.py`     — decode side: pull, hand the rows to admission, failure policy, aborts.
* `shards.py`       — a multi-process engine: the process holding a replica stages, pulls and
                      lands its KV (the leader only asks it to).

`PDConnector` bundles them for one engine; `SchedulerConnector` is what a scheduler (one per
data-parallel replica) calls (`serving/scheduler.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from serving.pd.config import PDConfig, PDConfigError, pd_config
from serving.pd.consumer import KVConsumer, RemoteKV
from serving.pd.params import KVTransferParamsError, parse_kv_transfer_params
from serving.pd.producer import KVProducer

logger = logging.getLogger(__name__)

__all__ = ["KVTransferParamsError", "PDConfig", "PDConfigError", "PDConnector", "RemoteKV", "SchedulerConnector",
           "build_pd", "parse_kv_transfer_params", "pd_config"]


@dataclass
class PDConnector:
    """One engine's P/D pieces: `producer` (roles kv_producer / kv_both) and `consumer` (kv_consumer
    / kv_both), over one transfer endpoint."""

    config: PDConfig
    producer: KVProducer | None
    consumer: KVConsumer | None

    def set_wake(self, fn) -> None:
        """`fn()` wakes the engine's driver (a side-channel job or a finished pull arrived)."""
        for part in (self.producer, self.consumer):
            if part is not None:
                part.wake = fn

    def close(self) -> None:
        if self.producer is not None and self.producer.side_channel is not None:
            self.producer.side_channel.close()

    def summary(self) -> str:
        c = self.config
        where = ""
        if self.producer is not None and self.producer.side_channel is not None:
            sc = self.producer.side_channel
            where = f"; side channel tcp://{sc.host}:{sc.port}"
        alias = " (vLLM's NixlConnector name; the transport is JAX's)" if c.connector == "NixlConnector" else ""
        pulls = ""
        if self.consumer is not None:
            pulls = f", pulls in chunks of {self.consumer.chunk_tokens} tokens (transfer_chunk_tokens)"
        return (f"P/D connector {c.connector}{alias}: {c.kv_role}, engine id {c.engine_id}, transport "
                f"jax.experimental.transfer{where}; kv_load_failure_policy {c.kv_load_failure_policy}, "
                f"abort_request_timeout {c.abort_request_timeout:.0f} s, kv_load_timeout {c.kv_load_timeout:.0f} s"
                f"{pulls}")


class SchedulerConnector:
    """What one scheduler (one data-parallel replica) calls: vLLM's scheduler-side connector hooks
    `request_finished` and `update_state_after_alloc`, plus the pages held for decode engines."""

    def __init__(self, pd: PDConnector, replica: int, kv, pool, policy=None):
        self.pd, self.replica, self.kv, self.pool, self.policy = pd, replica, kv, pool, policy

    def request_finished(self, req) -> None:
        if self.pd.producer is not None:
            req.kv_transfer_params_out = self.pd.producer.request_finished(req, self.kv, self.pool, self.replica)

    def update_state_after_alloc(self, req, hit=None) -> None:
        lease_of = getattr(self.policy, "lease_of", None)
        bounce = lease_of(req.request_id) if lease_of is not None else None
        self.pd.consumer.update_state_after_alloc(req, self.kv, self.replica, bounce, hit)

    def local_hit(self, req, hit):
        """The part of this engine's prefix hit a partial pull was planned around (None when the
        hit no longer covers it)."""
        from serving.pd.consumer import local_hit

        return local_hit(req.remote_kv, hit)

    def external_refs(self) -> dict[int, int]:
        return self.pd.producer.external_refs(self.pool) if self.pd.producer is not None else {}


def build_pd(config: PDConfig, layout, cfg, parallel, num_blocks: int, read_pages) -> PDConnector:
    """The connector for an engine with KV `layout` of model config `cfg` under `parallel`
    (a `ParallelLayout` or None); `read_pages` is the runner's page gather. Starts the side
    channel of a producer."""
    from serving.pd.layout import kv_layout_descriptor
    from serving.pd.side_channel import SideChannelServer
    from serving.pd.transfer import TransferEndpoint

    endpoint = TransferEndpoint(config.side_channel_host, config.num_transfer_sockets)
    desc = kv_layout_descriptor(layout, cfg)
    dcp = parallel.dcp if parallel is not None else 1
    interleave = parallel.config.dcp_kv_cache_interleave_size if parallel is not None else 1
    tp = parallel.tp if parallel is not None else 1
    producer = consumer = None
    if config.is_producer:
        producer = KVProducer(config, endpoint, layout, desc, dcp, interleave, num_blocks, read_pages, tp_size=tp)
        producer.side_channel = SideChannelServer(config.side_channel_host, config.side_channel_port, producer.handle)
    if config.is_consumer:
        consumer = KVConsumer(config, endpoint, layout, desc, dcp, interleave, num_blocks)
    return PDConnector(config, producer, consumer)
