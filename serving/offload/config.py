"""`--kv-transfer-config`: the CPU KV offloading connector's settings, as vLLM spells them.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 137438953472}}'

Top-level keys: `kv_connector` (only "OffloadingConnector"), `kv_role` ("kv_both", the default),
`kv_connector_extra_config` (an object). Extra-config keys: `cpu_bytes_to_use` (required, > 0:
the host store's size in bytes, rounded down to whole pages), `spec_name` ("CPUOffloadingSpec";
the reference's "TieringOffloadingSpec" is accepted with a start-up warning naming the key, and
means this one host tier),
`block_size` (accepted when it equals the engine's page of 64 tokens). Anything else is refused
with a message naming the key.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TOP_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
EXTRA_KEYS = ("cpu_bytes_to_use", "spec_name", "block_size")
CONNECTORS = ("OffloadingConnector",)
SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")


class OffloadConfigError(ValueError):
    """A `--kv-transfer-config` value this engine cannot serve; the message names the key."""


@dataclass(frozen=True)
class OffloadConfig:
    """Parsed `--kv-transfer-config` (module docstring)."""

    cpu_bytes_to_use: int
    spec_name: str = "CPUOffloadingSpec"
    kv_role: str = "kv_both"

    @classmethod
    def from_dict(cls, d: Any, page_tokens: int = 64) -> "OffloadConfig":
        """Parse the flag's JSON object. Raises OffloadConfigError naming the key."""
        flag = "--kv-transfer-config"
        if not isinstance(d, dict):
            raise OffloadConfigError(f"{flag} must be a JSON object, got {d!r}")
        unknown = sorted(set(d) - set(TOP_KEYS))
        if unknown:
            raise OffloadConfigError(f"{flag}: unknown key(s) {unknown} (known: {', '.join(TOP_KEYS)})")
        conn = d.get("kv_connector")
        if conn not in CONNECTORS:
            raise OffloadConfigError(f"{flag} kv_connector {conn!r} is not supported (supported: "
                                     f"{', '.join(CONNECTORS)})")
        role = d.get("kv_role", "kv_both")
        if role != "kv_both":
            raise OffloadConfigError(f"{flag} kv_role {role!r} is not supported: the OffloadingConnector stores and "
                                     "loads (kv_both)")
        extra = d.get("kv_connector_extra_config")
        if not isinstance(extra, dict):
            raise OffloadConfigError(f"{flag} needs kv_connector_extra_config with cpu_bytes_to_use")
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise OffloadConfigError(f"{flag} kv_connector_extra_config: unknown key(s) {unknown} "
                                     f"(known: {', '.join(EXTRA_KEYS)})")
        n = extra.get("cpu_bytes_to_use")
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0:
            raise OffloadConfigError(f"{flag} kv_connector_extra_config.cpu_bytes_to_use must be a positive "
                                     f"number of bytes, got {n!r}")
        spec = extra.get("spec_name", "CPUOffloadingSpec")
        if spec not in SPECS:
            raise OffloadConfigError(f"{flag} kv_connector_extra_config.spec_name {spec!r} is not supported "
                                     f"(supported: {', '.join(SPECS)})")
        if spec != "CPUOffloadingSpec":
            logger.warning("%s kv_connector_extra_config.spec_name %r runs as CPUOffloadingSpec: this engine "
                           "has the one host tier", flag, spec)
        bs = extra.get("block_size")
        if bs is not None and bs != page_tokens:
            raise OffloadConfigError(f"{flag} kv_connector_extra_config.block_size {bs!r}: this engine offloads "
                                     f"whole pages of {page_tokens} tokens")
        return cls(int(n), spec, role)

    def host_blocks(self, page_bytes: int) -> int:
        """Host-store blocks for `cpu_bytes_to_use` (whole pages, rounded down) plus the null block."""
        return self.cpu_bytes_to_use // page_bytes + 1
