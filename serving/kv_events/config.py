"""`--kv-events-config`: vLLM's KV cache event settings, with vLLM's keys and defaults.

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

Keys (vLLM's `KVEventsConfig`): `enable_kv_cache_events` (default false: nothing is tracked or
published), `publisher` ("zmq", or "null" to track without publishing), `endpoint` (the PUB
socket; an address with `*`, `::`, `ipc://` or `inproc://` is bound, any other is connected to),
`replay_endpoint` (a ROUTER socket serving missed batches, or null), `buffer_steps` (batches kept
for replay), `hwm` (the PUB socket's high-water mark), `max_queue_size` (batches waiting for the
publisher thread; when it is full a batch is dropped and counted), `topic` (the first frame of
every message). Under data parallelism replica r publishes on the endpoint's port + r (and the
replay endpoint's port + r), as vLLM does; with `merge_data_parallel` (this server's key, default
false) the replicas publish one stream instead, on the endpoint itself as rank 0: the union of
what they hold (`serving/kv_events/merge.py`), for a router that does not pin requests to ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


class KVEventsConfigError(ValueError):
    """A bad `--kv-events-config` (the message names the key)."""


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    merge_data_parallel: bool = False

    @classmethod
    def from_dict(cls, raw: Any) -> KVEventsConfig | None:
        """Parse the flag's JSON (a str or a dict). Returns None when events are off.

        Raises KVEventsConfigError naming an unknown key or a bad value."""
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise KVEventsConfigError(f"--kv-events-config: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise KVEventsConfigError("--kv-events-config: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise KVEventsConfigError(f"--kv-events-config: unknown key {unknown[0]!r} (known: {sorted(known)})")
        cfg = cls(**raw)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise KVEventsConfigError("--kv-events-config: enable_kv_cache_events must be true or false")
        if cfg.publisher not in ("zmq", "null"):
            raise KVEventsConfigError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(cfg, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise KVEventsConfigError(f"--kv-events-config: {key} must be a positive integer, got {v!r}")
        for key in ("endpoint", "replay_endpoint"):
            v = getattr(cfg, key)
            if v is not None and (not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://"))):
                raise KVEventsConfigError(f"--kv-events-config: {key} must be a tcp://, ipc:// or inproc:// address, "
                                          f"got {v!r}")
        if not isinstance(cfg.topic, str):
            raise KVEventsConfigError("--kv-events-config: topic must be a string")
        if not isinstance(cfg.merge_data_parallel, bool):
            raise KVEventsConfigError("--kv-events-config: merge_data_parallel must be true or false")
        return cfg if cfg.enable_kv_cache_events else None


def check_replica_ports(config: "KVEventsConfig", num_replicas: int) -> None:
    """Replica r publishes on the endpoint's port + r and replays on the replay port + r: refuse
    (KVEventsConfigError naming `replay_endpoint`) tcp ports that would collide over
    `num_replicas` replicas, e.g. 5557 / 5558 with two replicas, before anything is bound."""
    ep, rp = config.endpoint, config.replay_endpoint
    if num_replicas < 2 or not rp or not (ep or "").startswith("tcp://") or not rp.startswith("tcp://"):
        return
    p, q = int(ep.rpartition(":")[2]), int(rp.rpartition(":")[2])
    if abs(p - q) < num_replicas:
        raise KVEventsConfigError(
            f"--kv-events-config: with {num_replicas} data-parallel replicas replica r publishes on port {p} + r "
            f"and replays on {q} + r, so ports {p}…{p + num_replicas - 1} and {q}…{q + num_replicas - 1} overlap; "
            f"choose a replay_endpoint port at least {num_replicas} away (e.g. {p + num_replicas})")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule for replica `data_parallel_rank`: a tcp port moves up by the rank, an inproc
    name gets `_dp<rank>`; rank 0 and None are unchanged. Raises KVEventsConfigError for an ipc
    endpoint under data parallelism (vLLM refuses it too)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise KVEventsConfigError(f"--kv-events-config: {endpoint!r} cannot be offset per data-parallel rank")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a publisher binds an address with `*` or `::` in it, or an ipc / inproc one, and
    connects to any other (e.g. `tcp://0.0.0.0:5557` or `tcp://10.0.0.1:5557`: an external broker
    must be listening there)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def is_ipv6(endpoint: str) -> bool:
    """A tcp address with an IPv6 literal (`tcp://[::]:5557`), which zmq binds only with its IPV6
    option set."""
    return endpoint.startswith("tcp://") and "[" in endpoint


# What vllm-router (0.1.17) needs of a discovery entry before it subscribes: without `encoding`
# "msgpack" and `schema_version` 1 beside `publisher` "zmq" and `enable_kv_cache_events` true it
# skips the rank without a word (probed against the binary; docs/kv_events.md "Discovery").
WIRE_ENCODING = "msgpack"
WIRE_SCHEMA_VERSION = 1
_BIND_ALL_HOSTS = ("*", "0.0.0.0", "[::]")


def discovery_sources(config: KVEventsConfig, num_replicas: int) -> dict[str, dict]:
    """The body of `GET /kv_event_sources`: one entry per data-parallel rank, keyed by the rank as a
    string (vllm-router's shape), each with the endpoints replica r publishes and replays on (the
    configured ports + r, `offset_endpoint_port`) and the publisher settings. Only sockets this
    server binds are listed, since a subscriber can reach only those: a tcp endpoint bound on every
    interface (`*`, `[::]`) is given as `tcp://*:PORT`, which a router reads as "the host of the
    worker URL I reached you at"; an ipc one as it is. Empty when the publisher is "null" or
    connects to its address (`binds`), or for an inproc endpoint (no other process can reach it);
    an inproc replay endpoint is given as null (the replay socket is always bound).

    Raises KVEventsConfigError for an ipc endpoint under data parallelism (as the publishers do)."""
    if config.publisher != "zmq" or not binds(config.endpoint) or config.endpoint.startswith("inproc://"):
        return {}
    replay = config.replay_endpoint  # always bound (a ROUTER socket), as vLLM's
    return {str(rank): {"endpoint": _router_address(offset_endpoint_port(config.endpoint, rank)),
                        "replay_endpoint": (_router_address(offset_endpoint_port(replay, rank))
                                            if replay and not replay.startswith("inproc://") else None),
                        "topic": config.topic, "hwm": config.hwm, "buffer_steps": config.buffer_steps,
                        "publisher": config.publisher, "enable_kv_cache_events": True,
                        "encoding": WIRE_ENCODING, "schema_version": WIRE_SCHEMA_VERSION}
            for rank in range(num_replicas)}


def _router_address(endpoint: str | None) -> str | None:
    """A bound socket's every-interface address (`tcp://[::]:5557`; `tcp://0.0.0.0:5558` for the
    replay socket, which is always bound) as `tcp://*:5557`; anything else unchanged."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return f"tcp://*:{port}" if host in _BIND_ALL_HOSTS else endpoint
