"""The KV event wire format: msgpack, as vLLM's `ZmqEventPublisher` sends it and vllm-router's
`kv_aware` policy reads it.

A message is three ZMQ frames: `topic` (utf-8), the batch's sequence number (8 bytes, big-endian,
from 0 per publisher) and the msgpack payload. The payload is an `EventBatch` encoded as an array
`[ts, events, data_parallel_rank]` (`ts`: seconds since the epoch, float), and every event is a
map tagged by its class name under `"type"`:

  BlockStored      {type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name}
  BlockRemoved     {type, block_hashes, medium}
  AllBlocksCleared {type}

`block_hashes` are this engine's prefix-cache unit hashes (16 bytes each, sent as msgpack bin);
`parent_block_hash` is the hash of the unit before the first one (None at the start of a prompt);
`token_ids` are the tokens of all the stored units in order (`len(block_hashes) * block_size`);
`medium` is "GPU" (device pages) or "CPU" (host memory: the Hybrid HiSparse host pool or the
offloading connector's store). vllm-router (0.1.17) requires exactly this shape: it rejects a batch
sent as a map ("KV event batch must be an array") and events sent as arrays ("KV event must be a
tagged map"). It indexes stored blocks by their `token_ids` (its own hashes of them), so our hash
function need not equal vLLM's; the hashes only link removals and parents to stored blocks.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the event types (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # required on the wire (vllm-router refuses a BlockStored without it)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError for a payload that is not a KV event batch."""
    return _decoder.decode(payload)
