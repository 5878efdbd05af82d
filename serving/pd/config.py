"""The P/D connector's part of `--kv-transfer-config` (vLLM's NixlConnector keys where they mean the
same; the transport is always JAX's `jax.experimental.transfer`).

    --kv-transfer-config '{"kv_connector": "JaxTransferConnector", "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"side_channel_port": 5600}}'

Top-level keys: `kv_connector` ("JaxTransferConnector", or vLLM's "NixlConnector" as an alias),
`kv_role` ("kv_producer": a prefill engine that hands KV out; "kv_consumer": a decode engine that
pulls it; "kv_both": either, per request), `engine_id` (default: a random id),
`kv_load_failure_policy` ("fail", vLLM's default: a request whose pull failed ends with an
error, a 500; "recompute": it is prefilled locally instead), `kv_buffer_device` ("cpu" or "cuda": accepted, the
staging is always a device array on the first device), `kv_connector_extra_config`.

Extra-config keys: `side_channel_host` (default 127.0.0.1: the address the side channel and the
transfer server bind to and advertise), `side_channel_port` (default 0: any free port; the
prefill response's `remote_port` says which), `abort_request_timeout` (seconds a prefill engine
keeps a finished request's KV for its decode engine to pull, default 480 as vLLM's
VLLM_NIXL_ABORT_REQUEST_TIMEOUT), `kv_load_timeout` (seconds a decode engine waits for one pull
before the failure policy applies, default 60), `num_transfer_sockets` (the transfer server's
transport sockets, default 2), `transfer_chunk_tokens` (ours: the most tokens one staged transfer
carries, default 16,384; a decode engine pulls a longer prompt in chunks of this many tokens, one
after another, so the staging buffers on both sides hold one chunk at a time — at GLM-5.3 sizes
16,384 tokens of every group are 0.84 GiB with the fp8 cache (54,728 B per token,
docs/results/capacity.txt), where a whole 1M-token request would be 53.4 GiB on one device). Anything else is refused naming the key.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from serving.kv_transfer_config import FLAG, KVTransferConfigError

TOP_KEYS = ("kv_connector", "kv_role", "engine_id", "kv_load_failure_policy", "kv_buffer_device",
            "kv_connector_extra_config")
EXTRA_KEYS = ("side_channel_host", "side_channel_port", "abort_request_timeout", "kv_load_timeout",
              "num_transfer_sockets", "kv_load_failure_policy", "transfer_chunk_tokens")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")


class PDConfigError(KVTransferConfigError):
    """A P/D connector setting this engine cannot serve; the message names the key."""


def _seconds(extra: dict, key: str, default: float) -> float:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise PDConfigError(f"{FLAG} kv_connector_extra_config.{key} must be a positive number of seconds, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class PDConfig:
    """Parsed P/D connector settings (module docstring)."""

    kv_role: str
    connector: str = "JaxTransferConnector"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    kv_load_failure_policy: str = "fail"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    abort_request_timeout: float = 480.0
    kv_load_timeout: float = 60.0
    num_transfer_sockets: int = 2
    transfer_chunk_tokens: int = 16384

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PDConfig":
        """Parse the connector's JSON object. Raises PDConfigError naming the key."""
        unknown = sorted(set(d) - set(TOP_KEYS))
        if unknown:
            raise PDConfigError(f"{FLAG} {d.get('kv_connector')}: unknown key(s) {unknown} (known: {', '.join(TOP_KEYS)})")
        role = d.get("kv_role")
        if role not in ROLES:
            raise PDConfigError(f"{FLAG} kv_role {role!r} is not supported by {d.get('kv_connector')} (supported: "
                                f"{', '.join(ROLES)})")
        extra = d.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise PDConfigError(f"{FLAG} kv_connector_extra_config must be a JSON object, got {extra!r}")
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise PDConfigError(f"{FLAG} kv_connector_extra_config: unknown key(s) {unknown} (known: "
                                f"{', '.join(EXTRA_KEYS)})")
        policy = d.get("kv_load_failure_policy", extra.get("kv_load_failure_policy", "fail"))
        if policy not in FAILURE_POLICIES:
            raise PDConfigError(f"{FLAG} kv_load_failure_policy {policy!r} is not supported (supported: "
                                f"{', '.join(FAILURE_POLICIES)})")
        dev = d.get("kv_buffer_device", "cpu")
        if dev not in ("cpu", "cuda"):
            raise PDConfigError(f"{FLAG} kv_buffer_device {dev!r} is not supported (cpu or cuda)")
        host = extra.get("side_channel_host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise PDConfigError(f"{FLAG} kv_connector_extra_config.side_channel_host must be a host name, got {host!r}")
        port = extra.get("side_channel_port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise PDConfigError(f"{FLAG} kv_connector_extra_config.side_channel_port must be a port number, got "
                                f"{port!r}")
        socks = extra.get("num_transfer_sockets", 2)
        if isinstance(socks, bool) or not isinstance(socks, int) or not 1 <= socks <= 64:
            raise PDConfigError(f"{FLAG} kv_connector_extra_config.num_transfer_sockets must be in 1…64, got {socks!r}")
        chunk = extra.get("transfer_chunk_tokens", 16384)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise PDConfigError(f"{FLAG} kv_connector_extra_config.transfer_chunk_tokens must be a positive number of "
                                f"tokens, got {chunk!r}")
        engine_id = d.get("engine_id")
        if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
            raise PDConfigError(f"{FLAG} engine_id must be a non-empty string, got {engine_id!r}")
        return cls(role, d.get("kv_connector"), engine_id or uuid.uuid4().hex[:16], policy, host, port,
                   _seconds(extra, "abort_request_timeout", 480.0), _seconds(extra, "kv_load_timeout", 60.0), socks,
                   chunk)


def pd_config(kv_transfer_config: dict | None) -> PDConfig | None:
    """The P/D connector's parsed settings (alone or inside a MultiConnector), or None. Raises
    KVTransferConfigError (PDConfigError) naming the key."""
    from serving.kv_transfer_config import split_kv_transfer_config

    _, pd = split_kv_transfer_config(kv_transfer_config)
    return None if pd is None else PDConfig.from_dict(pd)
