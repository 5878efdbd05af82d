"""`--kv-transfer-config`: which KV connectors an engine runs, as vLLM spells the flag.

    {"kv_connector": "OffloadingConnector", ...}                    the CPU KV offloading connector
    {"kv_connector": "JaxTransferConnector", "kv_role": ...}        prefill/decode disaggregation
    {"kv_connector": "NixlConnector", ...}                          the same (vLLM's name; JAX transport)
    {"kv_connector": "MultiConnector", "kv_role": ...,
     "kv_connector_extra_config": {"connectors": [{...}, {...}]}}    both, each a full config of its own

`split_kv_transfer_config` checks the connector names and the MultiConnector's shape and returns
each connector's own config; `serving/offload/config.py` and `serving/pd/config.py` check the
keys of theirs. Every error names the key.
"""

from __future__ import annotations

from typing import Any

OFFLOAD_CONNECTORS = ("OffloadingConnector",)
PD_CONNECTORS = ("JaxTransferConnector", "NixlConnector")
MULTI_CONNECTOR = "MultiConnector"
FLAG = "--kv-transfer-config"


class KVTransferConfigError(ValueError):
    """A `--kv-transfer-config` this engine cannot serve; the message names the key."""


def split_kv_transfer_config(d: Any) -> tuple[dict | None, dict | None]:
    """(offloading connector config, P/D connector config) of the flag's JSON object (None for
    an absent one; both None for None).

    Raises KVTransferConfigError: not an object, an unknown kv_connector, a MultiConnector without
    a `connectors` list, with extra keys, with nested MultiConnectors or with two connectors of one
    kind."""
    if d is None:
        return None, None
    if not isinstance(d, dict):
        raise KVTransferConfigError(f"{FLAG} must be a JSON object, got {d!r}")
    conn = d.get("kv_connector")
    if conn in OFFLOAD_CONNECTORS:
        return d, None
    if conn in PD_CONNECTORS:
        return None, d
    if conn != MULTI_CONNECTOR:
        known = ", ".join(OFFLOAD_CONNECTORS + PD_CONNECTORS + (MULTI_CONNECTOR,))
        raise KVTransferConfigError(f"{FLAG} kv_connector {conn!r} is not supported (supported: {known})")
    unknown = sorted(set(d) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
    if unknown:
        raise KVTransferConfigError(f"{FLAG} MultiConnector: unknown key(s) {unknown}")
    extra = d.get("kv_connector_extra_config")
    subs = extra.get("connectors") if isinstance(extra, dict) else None
    if not isinstance(subs, list) or not subs:
        raise KVTransferConfigError(f"{FLAG} MultiConnector needs kv_connector_extra_config.connectors, a non-empty "
                                    "list of connector configs")
    unknown = sorted(set(extra) - {"connectors"})
    if unknown:
        raise KVTransferConfigError(f"{FLAG} MultiConnector kv_connector_extra_config: unknown key(s) {unknown}")
    offload = pd = None
    for i, sub in enumerate(subs):
        where = f"kv_connector_extra_config.connectors[{i}]"
        if not isinstance(sub, dict) or sub.get("kv_connector") == MULTI_CONNECTOR:
            raise KVTransferConfigError(f"{FLAG} {where} must be the config of one connector (not a MultiConnector)")
        o, p = split_kv_transfer_config(sub)
        if (o is not None and offload is not None) or (p is not None and pd is not None):
            raise KVTransferConfigError(f"{FLAG} {where}: a second {sub.get('kv_connector')}; at most one connector "
                                        "of each kind")
        offload, pd = offload or o, pd or p
    role = d.get("kv_role")
    if pd is not None and role is not None and pd.get("kv_role", "kv_both") != role:
        raise KVTransferConfigError(f"{FLAG} MultiConnector kv_role {role!r} differs from its "
                                    f"{pd.get('kv_connector')}'s kv_role {pd.get('kv_role', 'kv_both')!r}")
    return offload, pd
