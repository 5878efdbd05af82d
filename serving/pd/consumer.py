"""The decode side of P/D: pull a remote-prefilled request's KV, then let the scheduler land it.

A request whose `kv_transfer_params` say `do_remote_prefill` is checked (prompt hash, token count,
KV row format) and parked here, not in the scheduler: a background thread asks the prefill
engine's side channel to stage the tokens and pulls them (`jax.experimental.transfer`), in chunks
of at most `transfer_chunk_tokens` tokens, one after another (each chunk copied to host memory
and its staging released before the next is asked for, so neither side stages more than one
chunk). Each engine step `poll` hands the requests whose bytes arrived to the scheduler
with their canonical rows attached (`Request.remote_kv`); admission then allocates the request's
pages as for any request, counts the transferred tokens as computed (vLLM's
`get_num_new_matched_tokens`: all prompt tokens but the last, which is computed again for its
logits) and queues the page writes (`update_state_after_alloc`), which the runner applies before
the step. A pull that fails or misses `kv_load_timeout` follows `kv_load_failure_policy`:
"recompute" prefills the request locally, "fail" ends it with an error. An abort while the pull
is in flight drops it and tells the prefill side.

In a multi-process engine whose replicas each live in one process, `shards`
(`serving/pd/shards.py`) has the process holding the request's replica pull each chunk into its
own host memory, and admission queues landing plans (`LandingPlan`) instead of page data: every
process then runs the same sharded page scatter, the owner supplying the pages.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from serving.pd import side_channel
from serving.pd.layout import layout_mismatch
from serving.pd.params import KVTransferParamsError, RemotePrefill, prompt_hash
from serving.pd.relayout import canonical_to_pages, words_per_token
from serving.pd.shards import LandingPlan

logger = logging.getLogger(__name__)


@dataclass
class RemoteKV:
    """Canonical rows of tokens `start` … `start + num_tokens − 1` per group, attached to a request
    whose pull completed (`Request.remote_kv`). On the direct path of a multi-process engine the
    rows are in process `owner`'s memory under `key` (`rows` is empty)."""

    start: int
    num_tokens: int
    rows: dict[str, np.ndarray]
    nbytes: int = 0
    host_pages: dict[int, int] = field(default_factory=dict)  # MLA page → host block (HiSparse landing)
    local_pages: dict[str, int] = field(default_factory=dict)  # pages per group from this engine's prefix cache
    key: str | None = None
    owner: int | None = None
    unplanned: object = None  # weakref.finalize: the owner forgets rows never landed (request aborted)


def plan_local_prefix(hit_tokens: int, layout, dcp: int) -> tuple[int, dict[str, int]]:
    """A decode engine holds the first `hit_tokens` tokens of a prompt in its prefix cache: each
    group keeps its whole pages of them (a partly covered page is pulled again rather than copied
    on write, since the pulled rows must land after any copy). Returns (the first token to pull:
    the earliest of the groups' page boundaries, pages per group)."""
    pages = {g.name: hit_tokens // (g.tokens_per_page * dcp) for g in layout.groups}
    start = min(pages[g.name] * g.tokens_per_page * dcp for g in layout.groups)
    return start, pages


def local_hit(land: "RemoteKV", hit):
    """`hit` cut to the pages `land.local_pages` planned (no copy-on-write, no load past them), or
    None when it no longer covers them."""
    from serving.prefix_cache import PrefixHit

    if hit is None:
        return None
    blocks = {}
    for g, n in land.local_pages.items():
        if len(hit.blocks.get(g, ())) < n:
            return None
        blocks[g] = list(hit.blocks[g][:n])
    mla = land.local_pages.get("mla", 0)
    out = PrefixHit(land.start, blocks, host_blocks={i: b for i, b in hit.host_blocks.items() if i < mla})
    for g, pages in hit.loads.items():
        kept = {i: hb for i, hb in pages.items() if i < land.local_pages.get(g, 0)}
        if kept:
            out.loads[g] = kept
            out.load_keys[g] = {i: hit.load_keys[g][i] for i in kept}
    if hit.num_local_tokens is not None:
        out.num_local_tokens = min(hit.num_local_tokens, land.start)
    return out


@dataclass
class PendingPull:
    request: object  # serving.request.Request
    remote: RemotePrefill
    num_tokens: int
    deadline: float
    started: float
    rows: dict[str, np.ndarray] | None = None  # canonical rows per group, once every chunk arrived
    reply: dict | None = None  # the last stage reply (its uuid is the staging a release drops)
    num_chunks: int = 0
    error: str | None = None
    aborted: bool = False
    start: int = 0
    local_pages: dict[str, int] = field(default_factory=dict)
    key: str | None = None  # the direct path: rows pulled by process `owner` under this key
    owner: int | None = None
    nbytes: int = 0


class KVConsumer:
    """Decode-side state (module docstring).

    Args:
      config: `serving.pd.config.PDConfig`. endpoint: the process's `TransferEndpoint`.
      layout: the engine's `KVCacheLayout`. descriptor: its `kv_layout_descriptor`.
      dcp / interleave: the engine's DCP size and interleave. num_blocks: pages per arena shard.
    """

    def __init__(self, config, endpoint, layout, descriptor: dict, dcp: int, interleave: int, num_blocks: int,
                 clock=time.monotonic):
        self.config = config
        self.endpoint = endpoint
        self.layout = layout
        self.descriptor = descriptor
        self.dcp, self.interleave, self.num_blocks = dcp, interleave, num_blocks
        self.clock = clock
        self.groups = [g.name for g in layout.groups]
        self.pending: dict[str, PendingPull] = {}
        self.writes: list[tuple[np.ndarray, np.ndarray]] = []  # (global rows, page data) for the runner
        self.shards = None  # serving.pd.shards.ShardRouter: the direct path of a multi-process engine
        self.plans: list[LandingPlan] = []  # the direct path's queued landings
        self.landed_keys: list[tuple[str, int]] = []  # their pulls, (key, owner) (forgotten once landed)
        self._keys = itertools.count(1)
        # HiSparse host landing: (replica, bounce pages, [(host block, per-rank page data)]); on the
        # direct path (host block, (LandingPlan without pages, page index)) instead.
        self.host_writes: list[tuple[int, list[int], list]] = []
        self.wake = None
        # Totals since start-up (metrics).
        from serving.pd.metrics import BYTE_BUCKETS, TIME_BUCKETS, Histogram

        self.num_transfers = 0
        self.num_failed_transfers = 0
        self.bytes_transferred = 0
        self.num_remote_tokens = 0
        self.xfer_time = Histogram(TIME_BUCKETS)
        self.xfer_bytes = Histogram(BYTE_BUCKETS)
        self.num_landed_device = 0
        self.num_landed_host = 0

    # ------------------------------------------------------------------ requests
    def add(self, request, remote: RemotePrefill, local_hit_tokens: int = 0) -> None:
        """Check `remote` against the request and this engine, then start the pull in the
        background: of the tokens past `local_hit_tokens`, the prompt prefix this engine's own
        prefix cache holds (whole pages of each group; `plan_local_prefix`). Raises
        `KVTransferParamsError` (a 400 naming the field) for a prompt or layout that does not match."""
        if remote.prompt_hash != prompt_hash(request.prompt_token_ids):
            raise KVTransferParamsError("kv_transfer_params.prompt_hash does not match this request's prompt: the KV "
                                        "the prefill engine holds is for another prompt", "kv_transfer_params.prompt_hash")
        if remote.remote_num_tokens > request.num_prompt_tokens:
            raise KVTransferParamsError(f"kv_transfer_params.remote_num_tokens {remote.remote_num_tokens} exceeds the "
                                        f"prompt's {request.num_prompt_tokens} tokens", "kv_transfer_params.remote_num_tokens")
        why = layout_mismatch(remote.kv_layout, self.descriptor, self.groups)
        if why is not None:
            raise KVTransferParamsError(f"kv_transfer_params.kv_layout: {why}", "kv_transfer_params.kv_layout")
        rid = request.request_id
        if rid in self.pending:
            raise ValueError(f"duplicate request id {rid!r}")
        n = min(remote.remote_num_tokens, request.num_prompt_tokens - 1)
        start, pages = plan_local_prefix(min(local_hit_tokens, n), self.layout, self.dcp)
        if start == 0:
            pages = {}  # pull (and write) everything
        now = self.clock()
        p = PendingPull(request, remote, n, now + self.config.kv_load_timeout, now, start=start, local_pages=pages)
        if self.shards is not None:
            p.owner = self.shards.owners[request.dp_rank or 0]
            p.key = f"{rid}#{next(self._keys)}"
        self.pending[rid] = p
        if n - start <= 0:  # nothing to pull (a one-token prompt): compute it here
            p.error = "nothing to pull"
            return
        threading.Thread(target=self._start_pull, args=(p,), name=f"pd-pull-{rid}", daemon=True).start()

    @property
    def chunk_tokens(self) -> int:
        """Tokens per pulled chunk: `transfer_chunk_tokens` rounded down to whole pages of the
        narrowest group (an engine page: 64 tokens × DCP), at least one page."""
        span = min(g.tokens_per_page for g in self.layout.groups) * self.dcp
        return max(span, self.config.transfer_chunk_tokens // span * span)

    def chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        """Token ranges [a, b) of one pull, `chunk_tokens` each (the last shorter). A page of a
        wider group (indexer keys, MTP rows) that straddles two chunks is read for both, each
        taking its own tokens."""
        step = self.chunk_tokens
        cuts = list(range(start, end, step)) + [end]
        return list(itertools.pairwise(cuts))

    def _start_pull(self, p: PendingPull) -> None:
        """The pull thread: stage and pull each chunk in turn, copy it to host memory and let the
        prefill side drop its staging; `p.rows` when all arrived, `p.error` on failure."""
        r = p.remote
        parts: dict[str, list[np.ndarray]] = {name: [] for name in self.groups}
        try:
            side_channel.check_reachable(r.remote_host, r.remote_port, timeout_s=min(5.0, self.config.kv_load_timeout))
            ranges = self.chunks(p.start, p.num_tokens)
            for i, (a, b) in enumerate(ranges):
                reply = side_channel.request(r.remote_host, r.remote_port, {
                    "op": "stage", "request_id": r.remote_request_id, "start": a, "num_tokens": b,
                    "last": i + 1 == len(ranges), "groups": self.groups, "kv_layout": self.descriptor,
                    "engine_id": r.remote_engine_id},
                    timeout_s=self.config.kv_load_timeout)
                p.reply = reply
                shapes = [tuple(s) for s in reply["shapes"]]
                for name, shape in zip(self.groups, shapes):  # the runtime checks byte sizes only
                    want = (b - a, words_per_token(self.layout.group(name)))
                    if shape != want:
                        raise ValueError(f"the prefill engine staged {shape} for group {name!r}, expected {want}")
                if p.aborted:
                    self._release(p)
                    return
                if p.key is not None:  # the process holding the replica pulls into its own memory
                    self.shards.pull(p.owner, {
                        "key": p.key, "chunk": i, "address": reply["transfer_address"], "uuid": int(reply["uuid"]),
                        "shapes": [list(s) for s in shapes], "groups": self.groups,
                        "request_id": p.request.request_id}, timeout_s=max(1.0, p.deadline - self.clock()))
                else:
                    pulled = self.endpoint.pull_rows(reply["transfer_address"], int(reply["uuid"]), shapes)
                    for name, rows in zip(self.groups, pulled):
                        parts[name].append(rows)
                p.num_chunks += 1
                p.nbytes += 4 * sum(a * b for a, b in shapes)
                if p.aborted:
                    self._release(p)
                    self._forget(p.key, p.owner)
                    return
                if i + 1 < len(ranges):  # the last chunk's staging is released with the request (poll)
                    self._release_chunk(p, reply["uuid"])
            p.rows = {} if p.key is not None else {
                name: v[0] if len(v) == 1 else np.concatenate(v) for name, v in parts.items()}
        except Exception as e:  # noqa: BLE001 - the failure policy decides
            p.error = f"{type(e).__name__}: {e}"
        finally:
            if self.wake is not None:
                self.wake()

    def _release_chunk(self, p: PendingPull, uuid) -> None:
        """Tell the prefill side one chunk of a pull still going on was pulled (it forgets that
        staging; the request's pages stay held until the last chunk is staged)."""
        r = p.remote
        try:
            side_channel.request(r.remote_host, r.remote_port, {"op": "release", "uuid": uuid, "pulled": True,
                                                                "engine_id": r.remote_engine_id}, timeout_s=10)
        except Exception as e:  # noqa: BLE001 - only bookkeeping: the staging expires on its own
            logger.info("release of a chunk of %s on the prefill engine failed: %s", r.remote_request_id, e)

    def _release(self, p: PendingPull, pulled: bool = False) -> None:
        """Tell the prefill side we are done with (`pulled`) or gave up on the request, so it drops
        what it still holds (pages, or staged rows nobody will pull); never raises."""
        r = p.remote
        msg = {"op": "release", "request_id": r.remote_request_id, "pulled": pulled, "engine_id": r.remote_engine_id}
        if p.reply is not None:
            msg["uuid"] = p.reply["uuid"]

        def send():
            try:
                side_channel.request(r.remote_host, r.remote_port, msg, timeout_s=10)
            except Exception as e:  # noqa: BLE001
                logger.info("release of %s on the prefill engine failed: %s", r.remote_request_id, e)

        threading.Thread(target=send, daemon=True).start()

    def poll(self) -> tuple[list, list]:
        """(requests whose KV arrived, with `remote_kv` set; (request, reason) pairs whose pull
        failed or timed out). Both leave `pending`."""
        ready, failed = [], []
        now = self.clock()
        for rid, p in list(self.pending.items()):
            if p.rows is not None:
                rows = p.rows
                nbytes = p.nbytes
                land = RemoteKV(p.start, p.num_tokens - p.start, rows, nbytes,
                                local_pages={g: n for g, n in p.local_pages.items() if n}, key=p.key, owner=p.owner)
                if p.key is not None:
                    land.unplanned = weakref.finalize(land, self._forget, p.key, p.owner)
                    land.unplanned.atexit = False
                p.request.remote_kv = land
                self.num_transfers += 1
                self.bytes_transferred += nbytes
                self.xfer_time.observe(now - p.started)
                self.xfer_bytes.observe(nbytes)
                logger.debug("request %s: %d tokens of KV (%.2f MiB, %d chunk(s)) pulled from engine %s in %.1f ms",
                             rid, p.num_tokens - p.start, nbytes / 2**20, p.num_chunks, p.remote.remote_engine_id,
                             1e3 * (now - p.started))
                del self.pending[rid]
                self._release(p, pulled=True)
                ready.append(p.request)
            elif p.error is not None or now > p.deadline:
                failed.append((p, p.error or f"no KV within {self.config.kv_load_timeout:.0f} s (kv_load_timeout)"))
        for p, _ in failed:
            p.aborted = True  # a pull thread still going stops at its next chunk
            self.pending.pop(p.request.request_id, None)
            self._forget(p.key, p.owner)
            if p.error != "nothing to pull":
                self.num_failed_transfers += 1
            self._release(p)
        return ready, [(p.request, why) for p, why in failed]

    def abort(self, request_id: str):
        """Drop a request still waiting for its KV; returns it (None when not pending)."""
        p = self.pending.pop(request_id, None)
        if p is None:
            return None
        p.aborted = True
        self._release(p)
        self._forget(p.key, p.owner)
        return p.request

    def _forget(self, key: str | None, owner: int | None) -> None:
        """The direct path: process `owner` drops the rows it pulled under `key` (never landed)."""
        if key is not None and self.shards is not None:
            self.shards.drop([(key, owner)])

    # ------------------------------------------------------------------ scheduler hooks
    def update_state_after_alloc(self, req, kv, replica: int = 0, bounce: list[int] | None = None,
                                 hit=None) -> None:
        """The scheduler allocated `req`'s pages: queue the writes of its transferred rows, to
        device pages, and to host blocks for the MLA pages admission landed in the HiSparse host
        pool (`land.host_pages`; they go through `bounce`, the request's hot lease pages, which
        the first step resolves afresh)."""
        land: RemoteKV = req.remote_kv
        host = []
        for g in self.layout.groups:
            span = g.tokens_per_page * self.dcp
            first = land.local_pages.get(g.name, 0)  # pages below come from this engine's prefix hit
            n_pages = math.ceil((land.start + land.num_tokens) / span) - first
            if n_pages <= 0:
                continue
            blocks = np.asarray(kv.block_table(req.request_id, g.name)[first:first + n_pages], np.int64)
            skip = first * span - land.start
            if land.key is not None:  # the owner builds the pages; every process lands them
                plan = LandingPlan(land.key, replica, g.name, first, n_pages, skip, land.num_tokens)
                on_host = [i for i in range(n_pages) if g.name == "mla" and first + i in land.host_pages]
                self.plans.append(dataclasses.replace(plan, pages=[(i, int(blocks[i])) for i in range(n_pages)
                                                                   if i not in set(on_host)]))
                host += [(land.host_pages[first + i], (plan, i)) for i in on_host]
                continue
            shards = canonical_to_pages(land.rows[g.name][skip:land.num_tokens], first * span, g,
                                        self.layout.page_words, first, n_pages, self.dcp, self.interleave)
            on_host = [i for i in range(n_pages) if g.name == "mla" and first + i in land.host_pages]
            keep = np.asarray([i for i in range(n_pages) if i not in set(on_host)], np.int64)
            for rank, pages in enumerate(shards):
                rows = ((replica * self.dcp + rank) * self.num_blocks + blocks[keep]).astype(np.int32)
                self.writes.append((rows, pages[keep]))
            for i in on_host:
                host.append((land.host_pages[first + i], [pages[i] for pages in shards]))
        if host:
            if not bounce:
                raise RuntimeError(f"request {req.request_id!r} lands pages in the host pool without a hot lease")
            self.host_writes.append((replica, list(bounce), host))
            self.num_landed_host += 1
        else:
            self.num_landed_device += 1
        self.num_remote_tokens += land.num_tokens
        if land.key is not None:
            land.unplanned.detach()  # landed with this step's plans, then forgotten
            self.landed_keys.append((land.key, land.owner))
        req.remote_kv = None  # the rows now live in the write queue

    def take_writes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The queued page writes as (global rows int32[n], data uint32[n, page_words]); clears."""
        if not self.writes:
            return None
        rows = np.concatenate([r for r, _ in self.writes])
        data = np.concatenate([d for _, d in self.writes])
        self.writes = []
        return rows, data

    def take_plans(self) -> tuple[list[LandingPlan], list[tuple[str, int]]]:
        """The direct path's queued landings and the pulls they finish (forgotten after landing); clears."""
        out = (self.plans, self.landed_keys)
        self.plans, self.landed_keys = [], []
        return out

    def take_host_writes(self) -> list[tuple[int, list[int], list]]:
        """The queued host-pool landings (replica, bounce pages, [(host block, per-rank pages)]); clears."""
        out, self.host_writes = self.host_writes, []
        return out
