"""The P/D data plane: one `jax.experimental.transfer` server per engine (in a multi-process
engine, the leader's: it stages and pulls on its first local device).

The runtime (jax 0.11.2) moves raw shard bytes: the producer offers arrays under a uint64 uuid
(`await_pull`), the consumer pulls them into arrays of the shapes it names (`pull`), pairing
buffers by shard order and checking byte sizes only. So the engine (1) stages exactly the arrays
the consumer will ask for, single-device `uint32[tokens, words]` canonical rows
(`serving/pd/relayout.py`), their shapes agreed on the side channel first; (2) never lets a
uuid be pulled twice (a second pull of a consumed uuid never completes); (3) keeps its own
deadlines (the runtime's are lazy); (4) keeps one connection per peer for every pull.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)


class TransferEndpoint:
    """This process's transfer server (started on first use) and its connections to peers.

    Args:
      host: the address to bind and advertise. num_sockets: transport sockets of the server.
    """

    def __init__(self, host: str = "127.0.0.1", num_sockets: int = 2):
        self.host = host
        self.num_sockets = num_sockets
        self._server = None
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()
        # uuids unique per server: a random 32-bit prefix per process and a counter.
        self._ids = itertools.count(1)
        self._prefix = int.from_bytes(os.urandom(4), "little") << 31

    @property
    def server(self):
        with self._lock:
            if self._server is None:
                from jax.experimental import transfer

                dev = jax.local_devices()[0]
                self._server = transfer.start_transfer_server(dev.client, f"{self.host}:0",
                                                              [f"{self.host}:0"] * self.num_sockets)
                logger.info("KV transfer server (jax.experimental.transfer) at %s", self._server.address())
            return self._server

    @property
    def address(self) -> str:
        return self.server.address()

    def new_uuid(self) -> int:
        return (self._prefix | next(self._ids)) & (2**63 - 1)

    def offer(self, uuid: int, rows: list[np.ndarray]) -> list[jax.Array]:
        """Stage `rows` (host arrays) on the first device and offer them under `uuid`. Returns the
        staged arrays (keep them to `.delete()` them at a deadline; dropping the reference is
        enough once pulled: the transfer table owns them until then)."""
        dev = jax.local_devices()[0]  # (jax.devices()[0] may be another process's device)
        staged = [jax.device_put(r, dev) for r in rows]
        jax.block_until_ready(staged)
        self.server.await_pull(uuid, staged)
        return staged

    def pull(self, address: str, uuid: int, shapes: list[tuple[int, int]]) -> list[jax.Array]:
        """Start pulling `uuid` from the server at `address` into single-device uint32 arrays of
        `shapes` (the shapes the producer staged); returns the arrays at once (not ready until the
        bytes arrived: `is_ready()`)."""
        with self._lock:
            conn = self._conns.get(address)
        if conn is None:
            conn = self.server.connect(address)
            with self._lock:
                conn = self._conns.setdefault(address, conn)
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        specs = [jax.ShapeDtypeStruct(tuple(s), jnp.uint32, sharding=sharding) for s in shapes]
        return conn.pull(uuid, specs)

    def pull_rows(self, address: str, uuid: int, shapes: list[tuple[int, int]]) -> list[np.ndarray]:
        """`pull`, then wait for the bytes: the rows as host arrays (the device copies deleted)."""
        rows = []
        for arr in self.pull(address, uuid, shapes):
            rows.append(np.asarray(arr))  # waits for the bytes
            arr.delete()
        return rows
