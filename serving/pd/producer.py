"""The prefill side of P/D: keep a finished request's KV for its decode engine, stage it on request.

When a request that came with `do_remote_decode` finishes (vLLM's `request_finished`), its pages
(every KV cache group, on every DCP rank) get one more reference each, so freeing the request
keeps them, and its response carries the `kv_transfer_params` the decode engine needs
(`serving/pd/params.py`). The decode engine then asks over the side channel to `stage` the tokens
it lacks: on the engine thread, the pages are read (one gather program), re-laid out into
canonical rows (`serving/pd/relayout.py`), staged on the device and offered to the transfer
server under a fresh uuid. A long prompt is staged in chunks (`transfer_chunk_tokens`, one stage
request each, the decode engine asking for the next after pulling one); the pages are released when
the last chunk is staged (the staged copy owns the data). A
request nobody stages within `abort_request_timeout` seconds is released (vLLM's
VLLM_NIXL_ABORT_REQUEST_TIMEOUT); staged rows nobody pulls within the same time are deleted.

Everything here runs on the engine thread: side-channel requests arrive on their own thread and
wait for `run_jobs`, which the engine calls every step and whenever it wakes up idle. In a
multi-process engine whose replicas each live in one process, `shards` (`serving/pd/shards.py`)
has the process holding the request's replica read and offer the rows on its own transfer server.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from serving.block_pool import NULL_BLOCK, BlockPool
from serving.pd.layout import layout_mismatch
from serving.pd.params import prompt_hash
from serving.pd.relayout import words_per_token
from serving.pd.shards import canonical_rows

logger = logging.getLogger(__name__)


@dataclass
class HeldKV:
    """A finished request's pages kept for its decode engine."""

    request_id: str
    pool: BlockPool
    replica: int
    blocks: dict[str, list[int]]
    num_tokens: int
    deadline: float


@dataclass
class StagedKV:
    request_id: str
    arrays: list | None  # None: staged by another process (`owner`)
    nbytes: int
    deadline: float
    owner: int = 0


class KVProducer:
    """Prefill-side state (module docstring).

    Args:
      config: `serving.pd.config.PDConfig`. endpoint: the process's `TransferEndpoint`.
      layout: the engine's `KVCacheLayout`. descriptor: its `kv_layout_descriptor`.
      dcp / interleave: the engine's DCP size and interleave. num_blocks: pages per arena shard.
      read_pages: `fn(global_rows int32[n]) -> uint32[n, page_words]` (the runner's gather).
      tp_size: reported in `kv_transfer_params`.
    """

    def __init__(self, config, endpoint, layout, descriptor: dict, dcp: int, interleave: int, num_blocks: int,
                 read_pages, tp_size: int = 1, clock=time.monotonic):
        self.config = config
        self.endpoint = endpoint
        self.layout = layout
        self.descriptor = descriptor
        self.dcp, self.interleave, self.num_blocks = dcp, interleave, num_blocks
        self.read_pages = read_pages
        self.tp_size = tp_size
        self.clock = clock
        self.held: dict[str, HeldKV] = {}
        self.staged: dict[int, StagedKV] = {}
        self._jobs: deque = deque()
        self._lock = threading.Lock()
        self.wake = None  # set by the engine's driver: called when a job arrives
        self.side_channel = None  # serving.pd.side_channel.SideChannelServer
        self.shards = None  # serving.pd.shards.ShardRouter: the direct path of a multi-process engine
        self.num_expired = 0
        self.num_staged = 0
        self.bytes_staged = 0

    # ------------------------------------------------------------------ scheduler hooks
    def request_finished(self, req, kv, pool: BlockPool, replica: int = 0) -> dict | None:
        """A request left the scheduler. For a `do_remote_decode` request that finished normally,
        keep its pages and return the `kv_transfer_params` of its response; else None."""
        if not req.do_remote_decode or req.finish_reason not in ("stop", "length") or not kv.has_request(req.request_id):
            return None
        n = min(req.num_computed_tokens, req.num_prompt_tokens)
        blocks = {}
        for g in self.layout.groups:
            t = kv.table(req.request_id, g.name)
            need = math.ceil(n / (g.tokens_per_page * self.dcp))
            if len(t.blocks) < need or any(not t.is_owned(i) for i in range(need)):
                logger.warning("request %s: its %s pages are not all on the device; its KV is not handed over",
                               req.request_id, g.name)
                return None
            blocks[g.name] = list(t.blocks[:need])
        for bs in blocks.values():
            pool.incref(bs)
        self.held[req.request_id] = HeldKV(req.request_id, pool, replica, blocks, n,
                                           self.clock() + self.config.abort_request_timeout)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.side_channel.port if self.side_channel is not None else self.config.side_channel_port,
            "remote_block_ids": list(blocks["mla"]),
            "remote_request_id": req.request_id,
            "tp_size": self.tp_size,
            "remote_num_tokens": n,
            "prompt_hash": prompt_hash(req.prompt_token_ids),
            "kv_layout": self.descriptor,
        }

    def external_refs(self, pool: BlockPool) -> dict[int, int]:
        """Page references held for decode engines in `pool` (block → count)."""
        refs: dict[int, int] = {}
        for h in self.held.values():
            if h.pool is pool:
                for bs in h.blocks.values():
                    for b in bs:
                        if b != NULL_BLOCK:
                            refs[b] = refs.get(b, 0) + 1
        return refs

    # ------------------------------------------------------------------ engine-thread jobs
    def submit(self, fn, timeout_s: float = 60.0):
        """Run `fn()` on the engine thread (from another thread) and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._jobs.append((fn, fut))
        if self.wake is not None:
            self.wake()
        return fut.result(timeout=timeout_s)

    def has_jobs(self) -> bool:
        """Side-channel jobs are queued, or a hold or staging is past its deadline (the engine's
        driver steps for either, idle or not)."""
        due = self.seconds_to_deadline()
        return bool(self._jobs) or (due is not None and due <= 0)

    def seconds_to_deadline(self) -> float | None:
        """Seconds until the earliest hold or staging passes its deadline (≤ 0: due now); None
        when nothing is held or staged. An idle engine's driver sleeps no longer than this, so
        an idle prefill server releases what nobody pulled on time (engine thread)."""
        deadlines = [h.deadline for h in self.held.values()] + [s.deadline for s in self.staged.values()]
        return min(deadlines) - self.clock() if deadlines else None

    def run_jobs(self) -> None:
        """Run queued side-channel jobs, then release what passed its deadline (engine thread)."""
        while True:
            with self._lock:
                if not self._jobs:
                    break
                fn, fut = self._jobs.popleft()
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the side channel answers with the error
                fut.set_exception(e)
        self.expire()

    def handle(self, msg: dict) -> dict:
        """The side channel's handler (its own thread). A stage or release naming another engine
        id (`kv_transfer_params.remote_engine_id`) is refused: such params are not this engine's
        answer, and must neither take nor drop the KV kept for the request that has them."""
        op = msg.get("op")
        engine_id = msg.get("engine_id")
        if engine_id is not None and engine_id != self.config.engine_id:  # as NIXL's handshake checks
            return {"ok": False, "error": f"kv_transfer_params.remote_engine_id {engine_id!r} is not this prefill "
                                          f"engine's ({self.config.engine_id!r}): the parameters came from another "
                                          "engine, or this one restarted"}
        if op == "stage":
            return self.submit(lambda: self.stage(msg))
        if op == "release":
            return self.submit(lambda: self.release(msg.get("request_id"), msg.get("uuid"), bool(msg.get("pulled"))))
        return {"ok": False, "error": f"unknown side-channel op {op!r}"}

    # ------------------------------------------------------------------ operations (engine thread)
    def stage(self, msg: dict) -> dict:
        """Stage tokens `msg["start"]` … `msg["num_tokens"]` − 1 of `msg["request_id"]`'s groups
        `msg["groups"]` and offer them; release the pages unless `msg["last"]` is False (a chunk
        of a chunked pull before its last). Returns the side channel's reply."""
        rid = msg.get("request_id")
        held = self.held.get(rid)
        if held is None:
            return {"ok": False, "error": f"the prefill engine holds no KV for request {rid!r} (never finished, "
                                          "already pulled, or released after abort_request_timeout)"}
        groups = list(msg.get("groups") or [])
        why = layout_mismatch(msg.get("kv_layout"), self.descriptor, groups)
        if why is not None:
            return {"ok": False, "error": why}
        start = int(msg.get("start", 0))
        end = min(held.num_tokens, int(msg.get("num_tokens", held.num_tokens)))
        if not 0 <= start < end:
            return {"ok": False, "error": f"tokens {start}…{end - 1} are not held (0…{held.num_tokens - 1} are)"}
        uuid = self.endpoint.new_uuid()
        shapes = [[end - start, words_per_token(self.layout.group(name))] for name in groups]
        if self.shards is not None:  # the process holding the replica reads and offers the rows
            owner = self.shards.owners[held.replica]
            self.shards.stage(owner, {"uuid": uuid, "request_id": rid, "replica": held.replica, "groups": groups,
                                      "blocks": {name: list(held.blocks[name]) for name in groups},
                                      "start": start, "end": end})
            arrays, address = None, self.shards.address(owner)
        else:
            owner = 0
            rows = [canonical_rows(self.read_pages, self.layout.group(name), self.dcp, self.interleave,
                                   self.num_blocks, held.replica, held.blocks[name], start, end) for name in groups]
            arrays, address = self.endpoint.offer(uuid, rows), self.endpoint.address
        nbytes = 4 * sum(a * b for a, b in shapes)
        if msg.get("last", True):
            self._release_pages(held)
        self.staged[uuid] = StagedKV(rid, arrays, nbytes, self.clock() + self.config.abort_request_timeout, owner)
        self.num_staged += 1
        self.bytes_staged += nbytes
        return {"ok": True, "uuid": uuid, "transfer_address": address, "groups": groups,
                "shapes": shapes, "start": start, "num_tokens": end}

    def _drop_staged(self, uuid: int, staged: StagedKV, pulled: bool) -> None:
        if staged.arrays is None:
            self.shards.unstage(staged.owner, uuid, pulled)
        elif not pulled:
            for a in staged.arrays:
                a.delete()

    def release(self, request_id: str | None, uuid=None, pulled: bool = False) -> dict:
        """The decode side is done with (`pulled`: the transfer table released the staged rows) or
        gave up on a request: drop its pages, and delete staged rows nobody will pull. Without
        `request_id` only the staged chunk `uuid` is concerned (a chunk of a pull still going on)."""
        held = self.held.get(request_id)
        if held is not None:
            self._release_pages(held)
        staged = self.staged.pop(int(uuid), None) if uuid is not None else None
        if staged is not None:
            self._drop_staged(int(uuid), staged, pulled)
        return {"ok": True}

    def _release_pages(self, held: HeldKV) -> None:
        self.held.pop(held.request_id, None)
        for bs in held.blocks.values():
            held.pool.free([b for b in reversed(bs) if b != NULL_BLOCK])

    def expire(self) -> None:
        """Release held pages and delete staged rows past their deadline."""
        now = self.clock()
        for h in [h for h in self.held.values() if h.deadline <= now]:
            logger.warning("request %s: no decode engine pulled its KV within %.0f s (abort_request_timeout); "
                           "its pages are released", h.request_id, self.config.abort_request_timeout)
            self._release_pages(h)
            self.num_expired += 1
        for uuid in [u for u, s in self.staged.items() if s.deadline <= now]:
            self._drop_staged(uuid, self.staged.pop(uuid), pulled=False)
            self.num_expired += 1

    def audit(self) -> list[str]:
        """Held pages must still be referenced in their pools."""
        errors = []
        for h in self.held.values():
            for g, bs in h.blocks.items():
                for b in bs:
                    if b != NULL_BLOCK and h.pool.refcount(b) < 1:
                        errors.append(f"P/D: page {b} ({g}) held for {h.request_id!r} is free")
        return errors
