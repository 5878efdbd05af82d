"""Whole-page reads and writes of the KV arena outside the step (P/D staging and landing).

A mixin of `serving.runner.ModelRunner`: it uses the runner's `kv_arena` (uint32
`[rows, page_words]`, donated by the write program), its `_put` (host inputs as the programs take
them) and its `step_sink`. In a multi-process engine (serving/multihost) the leader sends each
program's inputs to the followers first (`("read_pages", rows)`, `("write_pages", (rows, data))`:
every process runs the same program over its own arena shards), and the read's output is
replicated over the mesh, so the leader gets every process's pages from its own devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class ArenaPageIO:
    """`read_pages` / `write_pages` over `self.kv_arena`: one jitted gather or donated scatter per
    power-of-two row count (at least 8), at most `max_pages_per_program` rows per call (more rows
    run as several calls: a staged or landed chunk never needs a second whole copy of its pages on
    the device; at GLM-5.3 sizes 256 fp8 pages are 0.8 GiB)."""

    max_pages_per_program = 256
    # A multi-process leader sends each landed piece's pages to the followers in one step-channel
    # message, and a staged piece's gather output is replicated on every device: at most this many
    # bytes of pages per piece (at GLM-5.3 fp8 sizes, 3.3 MB pages: 16 per piece instead of 256,
    # so neither a message nor a device's copy holds 0.8 GiB).
    max_step_message_bytes = 64 << 20

    def _pages_per_call(self) -> int:
        """Rows per page program: `max_pages_per_program`, and for a multi-process leader the
        largest power of two (at least 8) whose pages fit `max_step_message_bytes`."""
        if self.step_sink is None:
            return self.max_pages_per_program
        fit = max(1, self.max_step_message_bytes // (4 * self.kv_arena.shape[1]))
        return min(self.max_pages_per_program, max(8, 1 << (fit.bit_length() - 1)))

    def _page_program(self, kind: str):
        """The jitted page gather ("read") or donated page scatter ("write") over the arena's rows
        (global rows `s · num_blocks + block`, s = replica · dcp + DCP rank), built on first use."""
        progs = self.__dict__.setdefault("_page_programs", {})
        if kind not in progs:
            sharding = self.kv_arena.sharding
            if kind == "read":
                replicated = None
                if jax.process_count() > 1:  # the pages of other processes' devices, on every process
                    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
                progs[kind] = jax.jit(lambda arena, rows: jnp.take(arena, rows, axis=0, mode="clip"),
                                      out_shardings=replicated)
            else:
                progs[kind] = jax.jit(lambda arena, rows, data: arena.at[rows].set(data, mode="drop"),
                                      donate_argnums=(0,), out_shardings=sharding)
        return progs[kind]

    @staticmethod
    def _page_bucket(n: int) -> int:
        b = 8
        while b < n:
            b *= 2
        return b

    def read_pages(self, rows) -> np.ndarray:
        """Contents of arena rows `rows` (int32[n]) as numpy `uint32[n, page_words]` (P/D staging;
        one gather program per power-of-two row count)."""
        rows = np.asarray(rows, np.int32)
        cap = self._pages_per_call()
        if len(rows) > cap:
            return np.concatenate([self.read_pages(rows[i:i + cap]) for i in range(0, len(rows), cap)])
        padded = np.zeros(self._page_bucket(len(rows)), np.int32)
        padded[:len(rows)] = rows
        if self.step_sink is not None:
            self.step_sink("read_pages", padded)
        return np.asarray(jax.device_get(self._page_program("read")(self.kv_arena, self._put(padded))))[:len(rows)]

    def write_pages(self, rows, data) -> None:
        """Arena rows `rows` (int32[n]) ← `data` (uint32[n, page_words]), before the next step (P/D
        landing); the arena is donated. Padding rows point past the arena and are dropped."""
        rows = np.asarray(rows, np.int32)
        cap = self._pages_per_call()
        if len(rows) > cap:
            for i in range(0, len(rows), cap):
                self.write_pages(rows[i:i + cap], data[i:i + cap])
            return
        n = self._page_bucket(len(rows))
        padded = np.full(n, self.kv_arena.shape[0], np.int32)
        padded[:len(rows)] = rows
        buf = np.zeros((n, self.kv_arena.shape[1]), np.uint32)
        buf[:len(rows)] = data
        if self.step_sink is not None:
            self.step_sink("write_pages", (padded, buf))
        self.kv_arena = self._page_program("write")(self.kv_arena, self._put(padded), self._put(buf))
