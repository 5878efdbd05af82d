"""`kv_transfer_params`: the per-request P/D protocol, as vLLM's NixlConnector speaks it.

A router sends the **prefill** engine the client's request with `max_tokens` 1 and
`{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, ...}`; the
prefill engine computes the prompt's KV, keeps it, and its response carries

    {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": ..., "remote_host": ...,
     "remote_port": ..., "remote_block_ids": [...], "remote_request_id": ..., "tp_size": ...,
     "remote_num_tokens": T, "prompt_hash": ..., "kv_layout": {...}}

which the router passes verbatim to the **decode** engine with the client's request; the decode
engine pulls the KV of the first T − 1 prompt tokens (the last one is computed again: its logits
give the first output token, as in vLLM) and generates. `remote_host` / `remote_port` name the
prefill engine's side channel (`serving/pd/side_channel.py`); `remote_block_ids` are its MLA
pages (informational: the pull is staged by request id); the last three keys are ours: the token
count held, a hash of the prompt's token ids and the KV row format (`serving/pd/layout.py`), all
checked before anything moves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np


class KVTransferParamsError(ValueError):
    """Malformed `kv_transfer_params` (a 400 naming `param`)."""

    def __init__(self, message: str, param: str = "kv_transfer_params"):
        super().__init__(message)
        self.param = param


def prompt_hash(token_ids) -> str:
    """sha256 (hex, 32 chars) of the prompt's int32 token ids: the decode side checks it was
    given the prompt whose KV the prefill side holds."""
    return hashlib.sha256(np.asarray(token_ids, np.int32).tobytes()).hexdigest()[:32]


@dataclass(frozen=True)
class RemotePrefill:
    """The decode side's view of a prefill response's `kv_transfer_params`."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_num_tokens: int
    prompt_hash: str
    kv_layout: dict
    remote_block_ids: tuple[int, ...] = ()
    tp_size: int = 1


def _field(d: dict, key: str, kinds, what: str):
    v = d.get(key)
    if v is None or isinstance(v, bool) or not isinstance(v, kinds):
        raise KVTransferParamsError(f"kv_transfer_params.{key} must be {what}, got {v!r}", f"kv_transfer_params.{key}")
    return v


def parse_kv_transfer_params(d: Any) -> tuple[bool, RemotePrefill | None]:
    """(do_remote_decode, the remote prefill to pull or None) of a request's `kv_transfer_params`.

    None / {} → (False, None). Raises KVTransferParamsError naming the field for a value that is
    not an object, flags that are not booleans, both flags set, or a remote prefill with a
    missing or mistyped field."""
    if d is None:
        return False, None
    if not isinstance(d, dict):
        raise KVTransferParamsError(f"kv_transfer_params must be an object, got {type(d).__name__}")
    flags = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        v = d.get(key, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise KVTransferParamsError(f"kv_transfer_params.{key} must be a boolean, got {v!r}",
                                        f"kv_transfer_params.{key}")
        flags[key] = v
    if flags["do_remote_decode"] and flags["do_remote_prefill"]:
        raise KVTransferParamsError("kv_transfer_params: do_remote_decode and do_remote_prefill are both true",
                                    "kv_transfer_params.do_remote_prefill")
    if not flags["do_remote_prefill"]:
        return flags["do_remote_decode"], None
    port = _field(d, "remote_port", int, "a port number")
    if not 0 < port < 65536:
        raise KVTransferParamsError(f"kv_transfer_params.remote_port must be a port number, got {port}",
                                    "kv_transfer_params.remote_port")
    n = _field(d, "remote_num_tokens", int, "the number of tokens the prefill engine holds")
    if n < 1:
        raise KVTransferParamsError(f"kv_transfer_params.remote_num_tokens must be >= 1, got {n}",
                                    "kv_transfer_params.remote_num_tokens")
    blocks = d.get("remote_block_ids") or []
    if not isinstance(blocks, list) or any(isinstance(b, bool) or not isinstance(b, int) for b in blocks):
        raise KVTransferParamsError("kv_transfer_params.remote_block_ids must be a list of integers",
                                    "kv_transfer_params.remote_block_ids")
    tp = d.get("tp_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise KVTransferParamsError(f"kv_transfer_params.tp_size must be a positive integer, got {tp!r}",
                                    "kv_transfer_params.tp_size")
    return False, RemotePrefill(
        remote_engine_id=_field(d, "remote_engine_id", str, "the prefill engine's id"),
        remote_host=_field(d, "remote_host", str, "the prefill engine's side-channel host"),
        remote_port=port,
        remote_request_id=_field(d, "remote_request_id", str, "the prefill request's id"),
        remote_num_tokens=n,
        prompt_hash=_field(d, "prompt_hash", str, "the prompt hash the prefill engine returned"),
        kv_layout=_field(d, "kv_layout", dict, "the KV layout the prefill engine returned"),
        remote_block_ids=tuple(blocks),
        tp_size=tp,
    )
