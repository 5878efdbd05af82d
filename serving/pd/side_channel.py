"""The P/D side channel: small JSON requests from a decode engine to a prefill engine over ZMQ.

The transfer runtime has no metadata, discovery or completion path of its own, so the engines
agree on what moves here: `stage` (the decode side names a request, the first token it needs and
its KV layout; the prefill side checks them, stages the rows, offers them under a fresh uuid and
answers with the uuid, its transfer server's address and the staged shapes) and `release` (the
decode side has the bytes, or gave up: the prefill side drops what it still holds for the
request). `SideChannelServer` answers on a REP socket from a thread of its own; each
`request` opens a REQ socket for one exchange, with a timeout (a REQ socket that missed its
reply cannot be reused).
"""

from __future__ import annotations

import json
import logging
import socket
import threading

import zmq

logger = logging.getLogger(__name__)


class SideChannelError(RuntimeError):
    """The peer did not answer in time, or answered with an error."""


class SideChannelServer:
    """Answer JSON requests with `handler(msg) -> reply dict` on tcp://host:port (port 0: any).

    The handler runs on the server's thread; an exception becomes `{"ok": false, "error": ...}`."""

    def __init__(self, host: str, port: int, handler):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pd-side-channel", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            raw = self._sock.recv()
            try:
                reply = self._handler(json.loads(raw))
            except Exception as e:  # noqa: BLE001 - answer every request
                logger.exception("side-channel request failed")
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            self._sock.send(json.dumps(reply).encode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(0)


def check_reachable(host: str, port: int, timeout_s: float) -> None:
    """Raise SideChannelError at once when nothing listens at host:port (the connection is refused:
    the prefill engine is gone), so a pull fails without waiting out `kv_load_timeout` (a ZMQ REQ
    socket retries a refused connection silently until its timeout). A peer that is only slow or
    unreachable within `timeout_s` is left to the request's own timeout."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError as e:
        raise SideChannelError(f"the prefill engine's side channel {host}:{port} refused the connection (is the "
                               "prefill server still running?)") from e
    except OSError:
        pass


def request(host: str, port: int, msg: dict, timeout_s: float) -> dict:
    """Send `msg` to the side channel at host:port and return its reply. Raises SideChannelError
    when no reply comes within `timeout_s` or the reply says `ok: false`."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(json.dumps(msg).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise SideChannelError(f"no answer from the prefill engine's side channel {host}:{port} within "
                                   f"{timeout_s:.0f} s")
        reply = json.loads(sock.recv())
    finally:
        sock.close(0)
    if not reply.get("ok"):
        raise SideChannelError(reply.get("error", "side-channel request refused"))
    return reply
