"""Whole-page reads and writes of the KV arena outside the step (P/D staging and landing).

A mixin of `serving.runner.ModelRunner`: it uses the runner's `kv_arena` (uint32
`[rows, page_words]`, donated by the write program), its `_put` (host inputs as the programs take
them) and its `step_sink`. In a multi-process engine (serving/multihost) the leader sends each
program's inputs to the followers first (`("read_pages", rows)`, `("write_pages", (rows, data))`:
every process runs the same program over its own arena shards), and the read's output is
replicated over the mesh, so the leader gets every process's pages from its own devices. Where
every attention replica's arena shards live in one process (`replica_owner`), P/D moves each
replica's pages on the process that holds them instead (`serving/pd/shards.py`): that process
reads them from its own shards (`read_local_pages`, no collective), and a landing is one
collective program whose page data is sharded like the arena, each process supplying the rows of
its own shards (`write_owned_pages`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


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

    # ------------------------------------------------------------------ per-process page I/O
    def _row_blocks(self) -> dict[int, list[jax.Device]]:
        """Arena row block (s = replica · dcp + DCP rank, `num_blocks` rows each) → the devices
        holding a copy of it (TP and PCP ranks hold the same block)."""
        blocks = self.__dict__.get("_row_block_devices")
        if blocks is None:
            blocks = {}
            for dev, index in self.kv_arena.sharding.devices_indices_map(self.kv_arena.shape).items():
                lo, hi, _ = index[0].indices(self.kv_arena.shape[0])
                for s in range(lo // self.num_blocks, hi // self.num_blocks):
                    blocks.setdefault(s, []).append(dev)
            self._row_block_devices = blocks
        return blocks

    def replica_owner(self, replica: int, dcp: int) -> int | None:
        """The one process whose devices hold every copy of replica `replica`'s arena shards (its
        `dcp` DCP ranks), or None when they are spread over several processes (a TP or DCP group
        spanning processes: P/D then goes through the leader)."""
        owners = {d.process_index for s in range(replica * dcp, (replica + 1) * dcp) for d in self._row_blocks()[s]}
        return owners.pop() if len(owners) == 1 else None

    def read_local_pages(self, rows) -> np.ndarray:
        """Contents of arena rows `rows` (int32[n], global rows), all in row blocks this process
        holds, as numpy `uint32[n, page_words]`: gathered from this process's own shards, one
        single-device program per block and power-of-two row count (no other process takes part).
        Raises ValueError for a row no local device holds."""
        rows = np.asarray(rows, np.int64)
        out = np.empty((len(rows), self.kv_arena.shape[1]), np.uint32)
        local = {}
        for shard in self.kv_arena.addressable_shards:
            lo = shard.index[0].indices(self.kv_arena.shape[0])[0]
            for s in range(lo // self.num_blocks, lo // self.num_blocks + shard.data.shape[0] // self.num_blocks):
                local.setdefault(s, (shard.data, lo))
        take = self.__dict__.setdefault("_local_take", jax.jit(lambda a, r: jnp.take(a, r, axis=0, mode="clip")))
        for s in np.unique(rows // self.num_blocks):
            if int(s) not in local:
                raise ValueError(f"arena row block {int(s)} is not held by process {jax.process_index()}")
            data, lo = local[int(s)]
            sel = np.nonzero(rows // self.num_blocks == s)[0]
            for i in range(0, len(sel), self.max_pages_per_program):
                part = sel[i:i + self.max_pages_per_program]
                idx = np.zeros(self._page_bucket(len(part)), np.int32)
                idx[:len(part)] = rows[part] - lo
                got = take(data, jax.device_put(idx, data.sharding))
                out[part] = np.asarray(got)[:len(part)]
        return out

    def write_owned_pages(self, pages: dict[int, tuple[np.ndarray, np.ndarray]], count: int) -> None:
        """Land pages in the arena in one program that every process runs (a multi-process
        engine's P/D landing without the leader in the data path).

        pages: arena row block s → (block-local rows int32[m], data uint32[m, page_words]), for
            the blocks this process holds (others are ignored; rows of other processes' blocks
            come from those processes).
        count: the most rows any block gets in this landing, the same on every process (the
            program's shape is `[blocks, bucket(count)]`).
        The data input is sharded like the arena's row blocks (`jax.make_array_from_callback`: each
        process builds its own devices' part), the scatter runs inside each shard (shard_map);
        padding rows point past the block and are dropped. The arena is donated.
        """
        cap = self.max_pages_per_program
        if count > cap:
            for i in range(0, count, cap):
                self.write_owned_pages({s: (r[i:i + cap], d[i:i + cap]) for s, (r, d) in pages.items()},
                                       min(cap, count - i))
            return
        n = self._page_bucket(max(count, 1))
        S, B, W = self.kv_arena.shape[0] // self.num_blocks, self.num_blocks, self.kv_arena.shape[1]
        spec0 = self.kv_arena.sharding.spec[0]
        mesh = self.kv_arena.sharding.mesh
        rows_sharding = NamedSharding(mesh, PartitionSpec(spec0, None))
        data_sharding = NamedSharding(mesh, PartitionSpec(spec0, None, None))

        def rows_of(index):
            sl = range(*index[0].indices(S))
            out = np.full((len(sl), n), B, np.int32)
            for i, s in enumerate(sl):
                if s in pages and len(pages[s][0]):
                    out[i, :len(pages[s][0])] = pages[s][0]
            return out

        def data_of(index):
            sl = range(*index[0].indices(S))
            out = np.zeros((len(sl), n, W), np.uint32)
            for i, s in enumerate(sl):
                if s in pages and len(pages[s][0]):
                    out[i, :len(pages[s][1])] = pages[s][1]
            return out

        rows_SN = jax.make_array_from_callback((S, n), rows_sharding, rows_of)
        data_SNW = jax.make_array_from_callback((S, n, W), data_sharding, data_of)
        progs = self.__dict__.setdefault("_page_programs", {})
        if "write_owned" not in progs:
            def land(arena, rows, data):  # one device's k blocks: [k·B, W], [k, n], [k, n, W]
                k = rows.shape[0]
                a = arena.reshape(k, B, W).at[jnp.arange(k)[:, None], rows].set(data, mode="drop")
                return a.reshape(k * B, W)

            progs["write_owned"] = jax.jit(jax.shard_map(
                land, mesh=mesh, in_specs=(PartitionSpec(spec0, None), PartitionSpec(spec0, None),
                                           PartitionSpec(spec0, None, None)),
                out_specs=PartitionSpec(spec0, None), check_vma=False), donate_argnums=(0,))
        self.kv_arena = progs["write_owned"](self.kv_arena, rows_SN, data_SNW)
