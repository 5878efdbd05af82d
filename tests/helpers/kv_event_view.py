"""A subscriber's view of KV events, written from vLLM's published schema (its field list in
`vllm/distributed/kv_events.py`) and the shape vllm-router accepts (the batch an array
`[ts, events, data_parallel_rank]`, every event a map tagged by `"type"`), not from our encoder.

`RouterView` rebuilds the stored blocks per medium the way a router does — by their tokens and
parent links, ignoring what our hash values are — and computes the prefix hit a prompt would get.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's BlockStored fields; every one must be on the wire (vllm-router 0.1.17 refuses a
# BlockStored without `lora_name`, even when it is null).
STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name"}
REMOVED_FIELDS = {"type", "block_hashes", "medium"}


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def decode(payload: bytes) -> Batch:
    return msgspec.msgpack.decode(payload, type=Batch)


class RouterView:
    def __init__(self):
        self.blocks: dict[bytes, dict] = {}  # hash -> {"parent", "tokens", "media"}
        self.block_size: int | None = None
        self.batches = 0

    def apply(self, batch: Batch) -> None:
        self.batches += 1
        for ev in batch.events:
            kind = ev["type"]
            if kind == "BlockStored":
                assert set(ev) >= STORED_FIELDS, f"BlockStored lacks {sorted(STORED_FIELDS - set(ev))}"
                bs = ev["block_size"]
                self.block_size = bs
                assert len(ev["token_ids"]) == bs * len(ev["block_hashes"])
                assert ev["lora_id"] is None and ev["medium"] in ("GPU", "CPU")
                parent = ev["parent_block_hash"]
                for i, h in enumerate(ev["block_hashes"]):
                    b = self.blocks.setdefault(h, {"parent": parent, "tokens": ev["token_ids"][i * bs:(i + 1) * bs],
                                                   "media": set()})
                    assert b["tokens"] == ev["token_ids"][i * bs:(i + 1) * bs] and b["parent"] == parent
                    assert ev["medium"] not in b["media"], "stored twice without a removal"
                    b["media"].add(ev["medium"])
                    parent = h
            elif kind == "BlockRemoved":
                assert set(ev) >= REMOVED_FIELDS, f"BlockRemoved lacks {sorted(REMOVED_FIELDS - set(ev))}"
                for h in ev["block_hashes"]:
                    b = self.blocks[h]
                    assert ev["medium"] in b["media"], "removed without being stored"
                    b["media"].discard(ev["medium"])
                    if not b["media"]:
                        del self.blocks[h]
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
            else:
                raise AssertionError(f"unknown event type {kind!r}")

    def media(self) -> dict[bytes, frozenset]:
        return {h: frozenset(b["media"]) for h, b in self.blocks.items()}

    def hit_tokens(self, prompt: list[int], media=("GPU", "CPU")) -> int:
        """Tokens of `prompt` a router would credit: the longest chain of stored blocks (on any of
        `media`) whose tokens are the prompt's, at most len(prompt) - 1 tokens."""
        if self.block_size is None:
            return 0
        bs = self.block_size
        by_content = {(b["parent"], tuple(b["tokens"])): h for h, b in self.blocks.items() if b["media"] & set(media)}
        parent, n = None, 0
        while (n + 1) * bs <= len(prompt) - 1:
            h = by_content.get((parent, tuple(prompt[n * bs:(n + 1) * bs])))
            if h is None:
                break
            parent, n = h, n + 1
        return n * bs


class Subscriber:
    """A ZMQ SUB socket on a publisher's endpoint (`tcp://127.0.0.1:PORT`) feeding a `RouterView`;
    `receive()` applies what arrived (waiting up to `timeout_s` for the first batch)."""

    def __init__(self, endpoint: str):
        import zmq

        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.view = RouterView()
        self.ranks: set[int | None] = set()
        self.seqs: list[int] = []

    def receive(self, timeout_s: float = 2.0) -> int:
        n = 0
        while self.socket.poll(int(timeout_s * 1000) if n == 0 else 50):
            _topic, seq, payload = self.socket.recv_multipart()
            batch = decode(payload)
            self.seqs.append(int.from_bytes(seq, "big"))
            self.ranks.add(batch.data_parallel_rank)
            self.view.apply(batch)
            n += 1
        return n

    def close(self) -> None:
        self.socket.close(linger=0)
