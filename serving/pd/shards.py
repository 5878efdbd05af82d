"""P/D on the process that holds the pages: a multi-process engine's direct transfer path.

In a multi-process engine (serving/multihost) whose attention replicas each live inside one
process (`ArenaPageIO.replica_owner`: DP across processes, TP / DCP inside them), a request's KV
is read, offered, pulled and landed by the process whose devices hold its replica, not by the
leader; only the control messages pass through the leader:

* **staging** (prefill side): the leader's producer, asked over its side channel, sends the
  owning process `("pd_stage", {...})`; that process reads the pages from its own shards
  (`read_local_pages`), re-lays them out into canonical rows and offers them on its own transfer
  server under the uuid the leader chose; the leader's reply names that server's address.
  `("pd_unstage", ...)` drops the staging (pulled, released or expired).
* **pulling** (decode side): the leader's pull thread, after the prefill side staged a chunk,
  sends the owning process `("pd_pull", {...})`; that process pulls it on a thread of its own,
  keeps the rows in host memory and reports `pd_pulled` (or the error) to the leader on the
  heartbeat channel; the leader then asks for the next chunk.
* **landing**: admission on the leader plans the page writes (`LandingPlan`: which pages of which
  pulled chunk go to which blocks); `("pd_land", plans)` makes every process run the same sharded
  page scatter (`write_owned_pages`), the owning process supplying the pages from its rows, and
  forget the rows of landed requests.

`ProcessKV` is that per-process part; the leader has one too, for its own replicas (it runs the
same operations in-process). Every operation runs on the process's engine thread (a follower's
step loop) except the pull itself.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from dataclasses import dataclass, field

import numpy as np

from serving.pd.relayout import canonical_to_pages, pages_to_canonical

logger = logging.getLogger(__name__)

OPS = ("pd_stage", "pd_unstage", "pd_pull", "pd_land", "pd_drop")
# Test hook: "1" makes a one-process engine on several devices take this path too (its one
# process holds every replica), so that one-process tests run the same staging, pulls and landings.
PER_PROCESS_ENV = "GLM53_PD_PER_PROCESS"


def canonical_rows(read, group, dcp: int, interleave: int, num_blocks: int, replica: int, blocks: list[int],
                   start: int, end: int) -> np.ndarray:
    """Canonical rows (`serving/pd/relayout.py`) of tokens `start … end − 1` of `group`, from the
    request's pages `blocks` (block-table order, all of them from page 0) in replica `replica`'s
    arena shards; `read(global rows int32[n]) -> uint32[n, page_words]` reads pages."""
    span = group.tokens_per_page * dcp
    first, last = start // span, math.ceil(end / span)
    b = np.asarray(blocks[first:last], np.int64)
    rows = np.concatenate([(replica * dcp + r) * num_blocks + b for r in range(dcp)])
    shards = np.split(read(rows.astype(np.int32)), dcp)
    canon = pages_to_canonical(shards, group, end - first * span, dcp, interleave, first_page=first)
    return np.ascontiguousarray(canon[start - first * span:])


@dataclass
class LandingPlan:
    """Page writes of one group of one pulled request, for the process holding its rows.

    key: the pull (`ProcessKV.pulled`). replica: the attention replica. group: the KV group.
    first / n_pages: the engine pages `canonical_to_pages` builds (from the group's page `first`).
    skip / num_tokens: the canonical rows `rows[skip:num_tokens]` they are built from (rows start
    at token `first · span`). pages: (index among the n_pages, destination block) pairs to write.
    """

    key: str
    replica: int
    group: str
    first: int
    n_pages: int
    skip: int
    num_tokens: int
    pages: list[tuple[int, int]] = field(default_factory=list)

    def encode(self) -> dict:
        return {"key": self.key, "replica": self.replica, "group": self.group, "first": self.first,
                "n_pages": self.n_pages, "skip": self.skip, "num_tokens": self.num_tokens,
                "pages": [list(p) for p in self.pages]}

    @classmethod
    def decode(cls, d: dict) -> LandingPlan:
        return cls(d["key"], int(d["replica"]), d["group"], int(d["first"]), int(d["n_pages"]), int(d["skip"]),
                   int(d["num_tokens"]), [(int(i), int(b)) for i, b in d["pages"]])


def advertised_host(side_channel_host: str, leader_host: str) -> str:
    """The address a follower's transfer server binds to and advertises: `side_channel_host` when
    it is a loopback address (a one-machine engine), else this machine's address on the route to
    the leader (the interface the peers of a multi-node deployment reach it by)."""
    if side_channel_host.startswith("127.") or side_channel_host in ("localhost", "::1"):
        return side_channel_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((leader_host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


class ProcessKV:
    """This process's part of the direct path (module docstring).

    Args:
      runner: the engine's `ModelRunner` (its `read_local_pages` / `write_owned_pages`).
      layout: the engine's `KVCacheLayout`. dcp / interleave / num_blocks: its DCP size,
      interleave and pages per arena shard. endpoint: this process's `TransferEndpoint`.
    """

    def __init__(self, runner, layout, dcp: int, interleave: int, num_blocks: int, endpoint):
        self.runner, self.layout = runner, layout
        self.dcp, self.interleave, self.num_blocks = dcp, interleave, num_blocks
        self.endpoint = endpoint
        self.staged: dict[int, list] = {}  # uuid → staged arrays (until pulled, released or expired)
        self.pulled: dict[str, list[dict[str, np.ndarray]]] = {}  # pull key → rows per group, per chunk
        self._pulling: set[str] = set()  # keys with a pull thread still going on here
        self._dropped: set[str] = set()  # of those, the ones forgotten meanwhile (their rows are not kept)
        # (key, group) → pages per DCP rank built from the rows: a request's host landing takes
        # several `land` calls (a lease's worth of pages each), which build them once.
        self._built: dict[tuple[str, str], list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.notify = None  # fn(event dict): a follower reports to the leader (heartbeat channel)
        self.num_staged = self.num_pulled = self.num_landed = 0

    # ------------------------------------------------------------------ prefill side
    def stage(self, msg: dict) -> int:
        """Read, re-lay out and offer tokens `msg["start"] … msg["end"] − 1` of the pages
        `msg["blocks"]` (group → blocks) of replica `msg["replica"]`, for `msg["groups"]` in that
        order, under `msg["uuid"]`. Returns the bytes staged."""
        rows = [canonical_rows(self.runner.read_local_pages, self.layout.group(name), self.dcp, self.interleave,
                               self.num_blocks, int(msg["replica"]), list(msg["blocks"][name]), int(msg["start"]),
                               int(msg["end"])) for name in msg["groups"]]
        self.staged[int(msg["uuid"])] = self.endpoint.offer(int(msg["uuid"]), rows)
        self.num_staged += 1
        return sum(r.nbytes for r in rows)

    def unstage(self, uuid: int, pulled: bool) -> None:
        """Forget staging `uuid`; delete its arrays unless the peer pulled them (the transfer
        table owns pulled ones)."""
        arrays = self.staged.pop(int(uuid), None)
        if arrays is not None and not pulled:
            for a in arrays:
                a.delete()

    # ------------------------------------------------------------------ decode side
    def pull(self, msg: dict, done) -> None:
        """Pull chunk `msg["chunk"]` of pull `msg["key"]` (uuid, address, group names and shapes
        from the prefill side's stage reply) into host memory, on a thread of its own; then
        `done({"op": "pd_pulled", "key", "chunk", "error"})` (error None when every byte arrived)."""

        with self._lock:
            self._pulling.add(msg["key"])

        def run():
            error = None
            try:
                rows = dict(zip(msg["groups"], self.endpoint.pull_rows(
                    msg["address"], int(msg["uuid"]), [tuple(s) for s in msg["shapes"]])))
                with self._lock:
                    if msg["key"] not in self._dropped:  # (dropped: the leader gave up on it meanwhile)
                        chunks = self.pulled.setdefault(msg["key"], [])
                        chunks.extend([None] * (int(msg["chunk"]) + 1 - len(chunks)))
                        chunks[int(msg["chunk"])] = rows
                self.num_pulled += 1
            except Exception as e:  # noqa: BLE001 - the leader's failure policy decides
                error = f"{type(e).__name__}: {e}"
                logger.warning("P/D: pulling chunk %s of %s failed on this process: %s", msg["chunk"], msg["key"], error)
            finally:
                with self._lock:
                    self._pulling.discard(msg["key"])
                    self._dropped.discard(msg["key"])
            done({"op": "pd_pulled", "key": msg["key"], "chunk": int(msg["chunk"]), "error": error})

        threading.Thread(target=run, name=f"pd-pull-{msg['key']}", daemon=True).start()

    def rows(self, key: str) -> dict[str, np.ndarray]:
        """The pulled rows of `key` per group, its chunks concatenated. Raises KeyError when this
        process pulled nothing under `key`."""
        with self._lock:
            chunks = self.pulled[key]
        if len(chunks) == 1:
            return chunks[0]
        return {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}

    def drop(self, key: str) -> None:
        """Forget the rows pulled under `key` (landed, failed or aborted; a pull of it still
        going on keeps nothing)."""
        with self._lock:
            self.pulled.pop(key, None)
            if key in self._pulling:
                self._dropped.add(key)
            for k in [k for k in self._built if k[0] == key]:
                del self._built[k]

    def land(self, plans: list[LandingPlan], owners: dict[int, int], me: int) -> None:
        """Run this landing's sharded page scatter (every process calls it with the same `plans`;
        `owners`: replica → the process holding it). This process supplies the pages of the plans
        whose replica it holds, from its pulled rows."""
        pages: dict[int, tuple[list, list]] = {}
        count: dict[int, int] = {}
        cache = self._built
        for p in plans:
            for rank in range(self.dcp):
                s = p.replica * self.dcp + rank
                count[s] = count.get(s, 0) + len(p.pages)
            if owners[p.replica] != me or not p.pages:
                continue
            g = self.layout.group(p.group)
            span = g.tokens_per_page * self.dcp
            if (p.key, p.group) not in cache:  # (several plans of one request's group: host landings)
                rows = self.rows(p.key)[p.group]
                cache[(p.key, p.group)] = canonical_to_pages(rows[p.skip:p.num_tokens], p.first * span, g,
                                                             self.layout.page_words, p.first, p.n_pages, self.dcp,
                                                             self.interleave)
            shards = cache[(p.key, p.group)]
            for rank in range(self.dcp):
                dst, data = pages.setdefault(p.replica * self.dcp + rank, ([], []))
                for i, block in p.pages:
                    dst.append(block)
                    data.append(shards[rank][i])
        if max(count.values(), default=0) == 0:
            return
        local = {s: (np.asarray(d, np.int32), np.stack(x)) for s, (d, x) in pages.items() if d}
        self.runner.write_owned_pages(local, max(count.values()))
        self.num_landed += len(plans)

    # ------------------------------------------------------------------ a follower's step loop
    def handle(self, op: str, msg, me: int) -> None:
        """Run a leader's P/D message on this follower (`OPS`): the staging, unstaging, pull and
        drop messages concern the process named `msg["process"]`; every process lands."""
        if op == "pd_land":
            self.land([LandingPlan.decode(p) for p in msg["plans"]], {int(k): int(v) for k, v in msg["owners"].items()},
                      me)
            return
        if op == "pd_drop":
            for key, owner in msg["keys"]:
                if int(owner) == me:
                    self.drop(key)
            return
        if int(msg["process"]) != me:
            return
        if op == "pd_stage":
            nbytes = self.stage(msg)
            logger.info("process %d: staged %d tokens (%.2f MiB) of request %s from its own arena shards",
                        me, int(msg["end"]) - int(msg["start"]), nbytes / 2**20, msg["request_id"])
        elif op == "pd_unstage":
            self.unstage(int(msg["uuid"]), bool(msg["pulled"]))
        elif op == "pd_pull":
            def done(event):
                if event["error"] is None:
                    logger.info("process %d: pulled chunk %d of %s (%s) into its own host memory", me,
                                event["chunk"], msg["request_id"], msg["key"])
                self.notify(event)

            self.pull(msg, done)
        else:
            raise ValueError(f"unknown P/D operation {op!r} from the leader")


class ShardRouter:
    """The leader's side of the direct path: which process holds each replica, that process's
    transfer server, and the P/D messages to it (module docstring).

    Args:
      local: the leader's own `ProcessKV`. owners: replica → process index. addresses: process
        index → its transfer server's address (the followers' from their HELLO). send: fn(op, msg)
        sending a message to every follower in step order (the runner's `step_sink`).
    """

    def __init__(self, local: ProcessKV, owners: dict[int, int], addresses: dict[int, str], send):
        self.local, self.owners, self.addresses, self.send = local, dict(owners), dict(addresses), send
        self._waiting: dict[tuple[str, int], list] = {}  # (key, chunk) → [Event, error]
        self._lock = threading.Lock()

    def address(self, process: int) -> str:
        """The transfer server address of `process` (the leader's own: started on first use)."""
        return self.local.endpoint.address if process == 0 else self.addresses[process]

    def stage(self, process: int, msg: dict) -> None:
        if process == 0:
            self.local.stage(msg)
        else:
            self.send("pd_stage", {**msg, "process": process})

    def unstage(self, process: int, uuid: int, pulled: bool) -> None:
        if process == 0:
            self.local.unstage(uuid, pulled)
        else:
            self.send("pd_unstage", {"process": process, "uuid": uuid, "pulled": pulled})

    def pull(self, process: int, msg: dict, timeout_s: float) -> None:
        """Have `process` pull one staged chunk (`ProcessKV.pull`'s message) and wait until it
        reports the rows in its host memory. Raises RuntimeError with the process's error, or
        TimeoutError after `timeout_s`."""
        slot = [threading.Event(), None]
        with self._lock:
            self._waiting[(msg["key"], int(msg["chunk"]))] = slot
        if process == 0:
            self.local.pull(msg, self.on_event)
        else:
            self.send("pd_pull", {**msg, "process": process})
        try:
            if not slot[0].wait(timeout_s):
                raise TimeoutError(f"process {process} did not pull chunk {msg['chunk']} within {timeout_s:.0f} s")
        finally:
            with self._lock:
                self._waiting.pop((msg["key"], int(msg["chunk"])), None)
        if slot[1] is not None:
            raise RuntimeError(f"process {process}'s pull failed: {slot[1]}")

    def on_event(self, event: dict) -> None:
        """A process's report (`pd_pulled`), from the heartbeat channel's thread or a pull thread."""
        if event.get("op") != "pd_pulled":
            return
        with self._lock:
            slot = self._waiting.get((event["key"], int(event["chunk"])))
        if slot is not None:
            slot[1] = event.get("error")
            slot[0].set()

    def land(self, plans: list[LandingPlan]) -> None:
        """Every process runs the sharded page scatter of `plans` (the leader last sends them)."""
        if not plans:
            return
        owners = {int(r): int(p) for r, p in self.owners.items()}
        self.send("pd_land", {"plans": [p.encode() for p in plans], "owners": {str(k): v for k, v in owners.items()}})
        self.local.land(plans, owners, 0)

    def drop(self, keys: list[tuple[str, int]]) -> None:
        """The processes named with `keys` ((key, owner) pairs) forget the rows pulled under them
        (best effort: never raises)."""
        if not keys:
            return
        for key, owner in keys:
            if owner == 0:
                self.local.drop(key)
        remote = [[k, o] for k, o in keys if o != 0]
        if not remote:
            return
        try:
            self.send("pd_drop", {"keys": remote})
        except Exception as e:  # noqa: BLE001 - a stopped engine has nothing to free
            logger.debug("P/D: could not tell the followers to drop %s: %s", keys, e)
