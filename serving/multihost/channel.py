"""The leader → follower step channel of a multi-process engine (pyzmq).

Sockets (the leader binds, followers connect):

* **steps** — leader ROUTER on `tcp://ADDR:PORT`, one DEALER per follower (routing id `p<id>`).
  Each follower first sends `HELLO {process_id, engine fingerprint}`; the leader waits for every
  follower (`wait_for_followers`) and answers every follower `START` when all fingerprints agree,
  `ABORT reason` when one differs (a follower waits for that answer before it compiles, so a
  refused one exits with the leader's reason instead of outliving it). Then the leader sends, in
  order: `STEP {seq, crc32} payload` (the step's inputs, `serving.multihost.codec`),
  `PING {seq}` every `heartbeat_s` (so an idle leader is not taken for a dead one), `STOP` (exit
  0) or `ABORT reason` (exit non-zero). The leader sends with ROUTER_MANDATORY: a follower whose
  connection is gone makes the send raise instead of dropping the step.
* **heartbeats** — leader PULL on `tcp://ADDR:PORT+1`, one PUSH per follower: `PING id` every
  `heartbeat_s` from a thread of its own, `FATAL id reason` when a follower stops on an error,
  `EVENT id body` for what a follower reports back (a P/D pull that finished: serving/pd/shards.py;
  the leader's `on_event(body)`).

Failure detection (fail-stop, docs/multihost.md): the leader's monitor thread declares a follower
lost when its heartbeat connection drops (a killed process: at once), when it sends FATAL, or when
it is silent for `peer_timeout_s` (a frozen process); a follower declares the leader lost when it
hears nothing (no step, no PING) for `peer_timeout_s`. A step whose sequence number is not the
next one, or whose payload fails its CRC32, is a `ChannelError` on the follower.

The leader's steps socket is shared by the engine thread (steps) and the heartbeat thread (PINGs)
under a lock; every other socket has one owning thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib

import msgspec
import zmq
import zmq.utils.monitor

logger = logging.getLogger(__name__)

# Test hook: the leader flips one byte of the payload of its n-th STEP message after computing
# the checksum (1-based), so that the followers' check can be exercised end to end.
CORRUPT_ENV = "GLM53_MULTIHOST_CORRUPT_STEP"


class ChannelError(RuntimeError):
    """A step message failed its sequence or checksum check, or the channel is unusable."""


class PeerLostError(RuntimeError):
    """A peer process is gone (killed, frozen past the timeout, or stopped on an error)."""


class StartRefused(RuntimeError):
    """The leader refused to start the engine after the handshake (its reason is the message)."""


def _endpoints(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return f"tcp://{host}:{int(port)}", f"tcp://{host}:{int(port) + 1}"


class LeaderChannel:
    """Process 0's end. `address` "HOST:PORT" (PORT and PORT + 1 are bound); `num_followers`
    processes are expected. `on_lost(reason)` is called once, from the monitor thread, when a
    follower is lost after the handshake."""

    def __init__(self, address: str, num_followers: int, peer_timeout_s: float = 10.0, heartbeat_s: float = 1.0,
                 on_lost=None):
        self.on_event = None  # fn(event dict) for a follower's EVENT (the monitor thread)
        self.peer_info: dict[int, dict] = {}  # process id → what its HELLO said besides the fingerprint
        self.num_followers = num_followers
        self.peer_timeout_s = float(peer_timeout_s)
        self.heartbeat_s = float(heartbeat_s)
        self.on_lost = on_lost
        self.seq = 0
        self.lost: str | None = None
        self._ctx = zmq.Context()
        steps_ep, beats_ep = _endpoints(address)
        self._steps = self._ctx.socket(zmq.ROUTER)
        self._steps.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._steps.setsockopt(zmq.SNDHWM, 0)
        self._steps.setsockopt(zmq.LINGER, 1000)
        self._beats = self._ctx.socket(zmq.PULL)
        self._beats.setsockopt(zmq.LINGER, 0)
        try:
            self._steps.bind(steps_ep)
            self._beats.bind(beats_ep)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"the multi-host channel cannot listen on {steps_ep} and {beats_ep} "
                             f"(--master-addr / --master-port): {e}") from None
        self._monitor = self._beats.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._peers: list[bytes] = []
        self._last_seen: dict[int, float] = {}
        self._corrupt_at = int(os.environ.get(CORRUPT_ENV, "0") or 0)
        logger.info("multi-host channel listening on %s (steps) and %s (heartbeats)", steps_ep, beats_ep)

    # ------------------------------------------------------------------ start-up
    def wait_for_followers(self, fingerprint: dict, timeout_s: float) -> None:
        """Block until every follower said HELLO with `fingerprint`, then start the heartbeat and
        monitor threads. Raises RuntimeError naming the process and the differing keys, or when
        a follower does not arrive within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        seen: dict[int, bytes] = {}
        poller = zmq.Poller()
        poller.register(self._steps, zmq.POLLIN)
        poller.register(self._beats, zmq.POLLIN)
        while len(seen) < self.num_followers:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.num_followers + 1)) - set(seen))
                self._peers = list(seen.values())  # so that `stop` tells the ones that came
                raise RuntimeError(f"process(es) {missing} did not join the engine within {timeout_s:.0f} s "
                                   "(--distributed-timeout); are they started with the same flags?")
            ready = dict(poller.poll(int(1000 * min(left, 1.0))))
            if self._beats in ready:  # a follower that failed while building its engine says so
                frames = self._beats.recv_multipart()
                if frames[0] == b"FATAL":
                    self._peers = list(seen.values())
                    raise RuntimeError(f"process {int(frames[1])} failed during start-up: "
                                       f"{frames[2].decode(errors='replace')}")
            if self._steps not in ready:
                continue
            ident, kind, body = self._steps.recv_multipart()
            if kind != b"HELLO":
                continue
            hello = msgspec.msgpack.decode(body)
            diff = sorted(k for k in set(fingerprint) | set(hello["fingerprint"])
                          if fingerprint.get(k) != hello["fingerprint"].get(k))
            if diff:
                # `stop` (the leader's exit) must reach this follower too: it waits for its first
                # step, and would otherwise outlive the leader until JAX's coordination client
                # finds the service gone and aborts the process.
                self._peers = [*seen.values(), ident]
                raise RuntimeError(
                    f"process {hello['process_id']} built a different engine: "
                    + "; ".join(f"{k}: leader {fingerprint.get(k)!r}, process {hello['process_id']} "
                                f"{hello['fingerprint'].get(k)!r}" for k in diff))
            seen[hello["process_id"]] = ident
            self.peer_info[hello["process_id"]] = dict(hello.get("info") or {})
        self._peers = [seen[p] for p in sorted(seen)]
        self._send_all([b"START", b"", b""])
        now = time.monotonic()
        self._last_seen = {p: now for p in seen}
        threading.Thread(target=self._heartbeat, name="multihost-heartbeat", daemon=True).start()
        threading.Thread(target=self._watch, name="multihost-monitor", daemon=True).start()
        logger.info("multi-host engine: %d follower process(es) joined", len(seen))

    # ------------------------------------------------------------------ sending
    def _send_all(self, frames: list[bytes]) -> None:
        with self._lock:  # (re-entrant: send_step holds it too)
            for ident in self._peers:
                try:
                    self._steps.send_multipart([ident, *frames])
                except zmq.ZMQError as e:
                    self._declare_lost(f"process {ident.decode()[1:]}: its connection closed (the process exited; "
                                       f"sending to it: {e})")
                    raise PeerLostError(self.lost) from None

    def send_step(self, payload: bytes) -> None:
        """Send one step's encoded inputs to every follower (next sequence number, CRC32).
        Raises PeerLostError when a follower is already known lost."""
        if self.lost is not None:
            raise PeerLostError(self.lost)
        with self._lock:  # (steps come from the engine thread, P/D pull requests from pull threads)
            self.seq += 1
            header = msgspec.msgpack.encode({"seq": self.seq, "crc": zlib.crc32(payload)})
            if self.seq == self._corrupt_at:
                payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
                logger.warning("%s: corrupting step message %d (test hook)", CORRUPT_ENV, self.seq)
            self._send_all([b"STEP", header, payload])

    def stop(self, abort_reason: str | None = None) -> None:
        """Tell every follower to exit (0 for a clean stop, non-zero with `abort_reason`) and close."""
        if self._closed.is_set():
            return
        frames = [b"STOP", b"", b""] if abort_reason is None else [b"ABORT", b"", abort_reason.encode()]
        self._closed.set()  # first: followers exiting on STOP are not taken for lost ones
        try:
            self._send_all(frames)
        except PeerLostError:
            pass
        time.sleep(0.2)  # let the frames leave before the context goes
        with self._lock:
            self._ctx.destroy(linger=500)

    # ------------------------------------------------------------------ threads
    def _heartbeat(self) -> None:
        while not self._closed.wait(self.heartbeat_s):
            try:
                self._send_all([b"PING", msgspec.msgpack.encode({"seq": self.seq}), b""])
            except (PeerLostError, zmq.ZMQError):
                return

    def _watch(self) -> None:
        poller = zmq.Poller()
        poller.register(self._beats, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._closed.is_set() and self.lost is None:
            try:
                ready = dict(poller.poll(200))
            except zmq.ZMQError:
                return
            now = time.monotonic()
            if self._beats in ready:
                while True:
                    try:
                        frames = self._beats.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    pid = int(frames[1])
                    if frames[0] == b"FATAL":
                        self._declare_lost(f"process {pid} stopped: {frames[2].decode(errors='replace')}")
                        return
                    self._last_seen[pid] = now
                    if frames[0] == b"EVENT" and self.on_event is not None:
                        try:
                            self.on_event(msgspec.msgpack.decode(frames[2]))
                        except Exception:
                            logger.exception("process %d's event could not be handled", pid)
            if self._monitor in ready:
                zmq.utils.monitor.recv_monitor_message(self._monitor)
                if not self._closed.is_set():
                    # A FATAL sent just before the disconnect names the cause; otherwise the process
                    # whose heartbeats stopped is the one that exited.
                    gone_at = time.monotonic()
                    time.sleep(1.5 * self.heartbeat_s)
                    self._drain_fatal(record_pings=True)
                    if self.lost is None:
                        quiet = sorted(p for p, t in self._last_seen.items() if t < gone_at)
                        who = f"process {', '.join(map(str, quiet))}" if quiet else "a follower process"
                        self._declare_lost(f"{who}: its connection closed (the process exited)")
                    return
            silent = [(p, now - t) for p, t in self._last_seen.items() if now - t > self.peer_timeout_s]
            if silent:
                p, s = silent[0]
                self._declare_lost(f"process {p} sent no heartbeat for {s:.1f} s (frozen or unreachable; "
                                   f"--peer-timeout {self.peer_timeout_s:g})")
                return

    def _drain_fatal(self, record_pings: bool = False) -> None:
        while True:
            try:
                frames = self._beats.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if record_pings and frames[0] == b"PING":
                self._last_seen[int(frames[1])] = time.monotonic()
            if frames[0] == b"FATAL":
                self._declare_lost(f"process {int(frames[1])} stopped: {frames[2].decode(errors='replace')}")
                return

    def _declare_lost(self, reason: str) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        logger.error("multi-host engine: %s; stopping every process", reason)
        if self.on_lost is not None:
            try:
                self.on_lost(reason)
            except Exception:
                logger.exception("on_lost callback failed")


class FollowerChannel:
    """A follower's end: connects to the leader at `address` "HOST:PORT" as `process_id`."""

    def __init__(self, address: str, process_id: int, peer_timeout_s: float = 10.0, heartbeat_s: float = 1.0):
        self.process_id = process_id
        self.peer_timeout_s = float(peer_timeout_s)
        self.heartbeat_s = float(heartbeat_s)
        self.expected_seq = 1
        self._ctx = zmq.Context()
        steps_ep, beats_ep = _endpoints(address)
        self.leader_host = address.rpartition(":")[0]
        self._steps = self._ctx.socket(zmq.DEALER)
        self._steps.setsockopt(zmq.ROUTING_ID, f"p{process_id}".encode())
        self._steps.setsockopt(zmq.LINGER, 0)
        self._steps.connect(steps_ep)
        self._beats = self._ctx.socket(zmq.PUSH)
        self._beats.setsockopt(zmq.LINGER, 1000)
        self._beats.connect(beats_ep)
        self._beat_lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._heartbeat, name="multihost-heartbeat", daemon=True).start()

    def hello(self, fingerprint: dict, info: dict | None = None) -> None:
        """Tell the leader this process built its engine (with `fingerprint`) and is ready;
        `info`: what the leader should know of it (its P/D transfer server's address)."""
        self._steps.send_multipart([b"HELLO", msgspec.msgpack.encode(
            {"process_id": self.process_id, "fingerprint": fingerprint, "info": info or {}})])

    def await_start(self, timeout_s: float) -> None:
        """After `hello`: wait up to `timeout_s` for the leader's answer. Returns when it accepted
        every process; raises `StartRefused` with the leader's reason when it refused to start
        (another process's fingerprint differs, or the leader failed), `PeerLostError` when no
        answer came."""
        kind, reason = self.recv(timeout_s)
        if kind == "abort":
            raise StartRefused(reason)
        if kind != "start":
            raise ChannelError(f"expected the leader's START after HELLO, got {kind!r}")

    def event(self, body: dict) -> None:
        """Report `body` to the leader (its `on_event`), on the heartbeat socket."""
        with self._beat_lock:
            self._beats.send_multipart([b"EVENT", str(self.process_id).encode(), msgspec.msgpack.encode(body)])

    def recv(self, timeout_s: float | None = None):
        """The next message: ("step", payload bytes) | ("stop", None) | ("abort", reason) |
        ("start", None) (the handshake's answer, `await_start`).
        PINGs are consumed here. Raises PeerLostError after `timeout_s` (default: the peer
        timeout) without any message, ChannelError on a bad sequence number or checksum."""
        timeout_s = self.peer_timeout_s if timeout_s is None else timeout_s
        while True:
            if not self._steps.poll(int(1000 * timeout_s)):
                raise PeerLostError(f"no message from the leader (process 0) for {timeout_s:g} s "
                                    "(it died or froze; --peer-timeout)")
            kind, header, body = self._steps.recv_multipart()
            if kind == b"PING":
                continue
            if kind == b"STOP":
                return "stop", None
            if kind == b"START":
                return "start", None
            if kind == b"ABORT":
                return "abort", body.decode(errors="replace")
            h = msgspec.msgpack.decode(header)
            if h["seq"] != self.expected_seq:
                raise ChannelError(f"step message {h['seq']} arrived when {self.expected_seq} was expected")
            if zlib.crc32(body) != h["crc"]:
                raise ChannelError(f"step message {h['seq']} failed its CRC32 check (corrupted in transit)")
            self.expected_seq += 1
            return "step", body

    def fatal(self, reason: str) -> None:
        """Tell the leader this follower stops on an error (best effort)."""
        with self._beat_lock:
            try:
                self._beats.send_multipart([b"FATAL", str(self.process_id).encode(), reason.encode()[:2000]])
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self._closed.set()
        with self._beat_lock:
            self._ctx.destroy(linger=500)

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.heartbeat_s):
            with self._beat_lock:
                if self._closed.is_set():
                    return
                try:
                    self._beats.send_multipart([b"PING", str(self.process_id).encode()], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
