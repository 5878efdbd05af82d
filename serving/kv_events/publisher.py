"""The ZMQ publisher: a PUB socket for live batches and a ROUTER socket for replays, served by one
thread, as vLLM's `ZmqEventPublisher` does (docs/kv_events.md).

Live: every batch goes out as `(topic, seq as 8 bytes big-endian, payload)`; `seq` counts from 0.
Replay: a client (a DEALER or REQ socket) sends `start_seq` (8 bytes big-endian) to the replay
endpoint and gets `(seq, payload)` for every kept batch with `seq >= start_seq` (the last
`buffer_steps` batches), then `(-1 as 8 signed bytes, b"")`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from serving.kv_events.config import (
    KVEventsConfig,
    binds,
    is_ipv6,
    offset_endpoint_port,
)
from serving.kv_events.wire import AllBlocksCleared, EventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """Publishes `EventBatch`es for one data-parallel replica.

    Args:
      config: the parsed `--kv-events-config`.
      data_parallel_rank: the replica; its endpoints are offset by it and every batch carries it.
      context: a `zmq.Context` (default: the process's shared instance).

    `publish` never blocks: when `max_queue_size` batches wait already, the batch is dropped
    (`num_dropped`). `num_published` counts batches sent on the PUB socket. Raises zmq.ZMQError
    at construction when an endpoint cannot be bound (the port is taken).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, context: zmq.Context | None = None):
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._ctx = context or zmq.Context.instance()
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_published = 0
        self.num_dropped = 0
        self._seq = 0
        self._clear_every: float | None = None  # `announce_cleared`: repeat the clear until a real batch
        self._next_clear = 0.0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if is_ipv6(self.endpoint):
                self._pub.setsockopt(zmq.IPV6, 1)  # `tcp://[::]:P`: IPv6 and IPv4 subscribers
            (self._pub.bind if binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                if is_ipv6(self.replay_endpoint):
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{data_parallel_rank}", daemon=True)
        self._thread.start()
        logger.info("KV events: replica %d publishes on %s%s", data_parallel_rank, self.endpoint,
                    f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    def publish(self, batch: EventBatch) -> bool:
        """Queue `batch` (its `data_parallel_rank` is set to this replica's). Returns False when it
        was dropped (queue full or publisher closed)."""
        if not self._running:
            self.num_dropped += 1
            return False
        batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV events: the publisher queue is full (%d batches); a batch was dropped",
                           self.config.max_queue_size)
            return False
        return True

    def announce_cleared(self, every_s: float = 1.0) -> None:
        """Send `AllBlocksCleared` now, and again every `every_s` seconds until another batch goes
        out. A PUB socket drops what it sends before a subscriber's subscription arrives, so a
        router that reconnects after this process bound its endpoint (a restart on the same
        endpoint) would miss a single clear and credit this replica with what the previous process
        announced until the first real batch; repeated, the clear reaches it within `every_s` of
        its reconnect. Repeating it is harmless while nothing else was announced (nothing is
        stored yet), and stops once something was."""
        self._clear_every = every_s
        self._next_clear = 0.0

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch went out; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for at most `timeout` seconds), stop the thread, close the sockets."""
        if not self._running:
            return
        self.flush(timeout)
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV events: replay request failed")
            if self._clear_every is not None and self._queue.empty() and time.monotonic() >= self._next_clear:
                self._next_clear = time.monotonic() + self._clear_every
                clear = EventBatch(ts=time.time(), events=[AllBlocksCleared()])
                clear.data_parallel_rank = self.data_parallel_rank
                self._send(clear)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                self._queue.task_done()
                return
            if any(not isinstance(e, AllBlocksCleared) for e in batch.events):
                self._clear_every = None  # something is announced: a clear would now unsay it
            try:
                self._send(batch)
            finally:
                self._queue.task_done()

    def _send(self, batch: EventBatch) -> None:
        try:
            payload = encode_batch(batch)
            self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1
            self.num_published += 1
        except zmq.ZMQError:
            self.num_dropped += 1
            logger.exception("KV events: sending a batch failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) < 2 or len(frames[-1]) != 8:
            logger.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        head, start = frames[:-1], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((*head, END_SEQ, b""))
