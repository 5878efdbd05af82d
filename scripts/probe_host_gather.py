"""Probe: the HiSparse host→device hot-row copy and the write-through page store, per mechanism.

What it measures (`kernels/host_rows/ops.py`, docs/design.md §4.3, §6.1.1), on whatever backend is there:

* **copy** — one decode step's worth of hot-row copies (`copy_host_rows`), at production row
  sizes: a host pool of token-major rows of 79 sparse-MLA layers (78 backbone + the MTP layer) ×
  164 uint32 words (the `fp8_ds_mla` row, 656 B per layer: 51,824 B per token), an arena of
  `fp8_ds_mla` MLA pages (64 tokens × 79 layers, 3.3 MB) holding a hot lease of `--hot-rows` rows per request. For
  batch B, top-k K and miss fraction f, every request misses round(f·K) distinct host rows in
  every IndexShare group (GLM-5.3: 21 groups, sizes 1, 1, then 19 × 4 layers; the MTP layer is in
  the pool row but in no group) and each miss lands in a distinct random slot of its request's
  lease. The miss lists are laid out as the step has them (`glm53/attention.py::resolve_hot`):
  `int32[B·K]` per group, valid entries first, −1 after, so one compiled function per (mechanism,
  B) serves every miss fraction. All 21 `copy_host_rows` calls run in ONE jitted function (the
  irregular head groups one by one, the 18 stacked groups under `lax.scan` with a traced first
  layer, as the model runs them; `--unrolled` unrolls them), so its time is what the copies add
  to a step. Reported: host rows and layer rows copied, host→device bytes, the added step time
  (median of repeats after one warm-up; compile timed separately), rows/s, GB/s, and µs per loop
  iteration (memory_kind: one iteration per host row per group; callback: one `io_callback` per
  chunk of `CALLBACK_CHUNK` rows). Miss fraction 0 is the fixed cost of the loops (zero trips).
  The callback mechanism is also run with other chunk sizes (`--callback-chunks`, later in the
  priority order) by setting `kernels.host_rows.ops.CALLBACK_CHUNK` while tracing.
* **store** — the write-through pre-copy (`store_pages`) of C arena pages to host blocks per step
  (C ∈ {1, 8, 64}; the store list is padded with −1 to the largest C, as the runner pads it):
  added step time and GB/s of device→host bytes.
* **h2d_ref** — a reference per mechanism: one contiguous `--ref-mib` slab of the pool moved to
  the device in one go (memory_kind: one `dynamic_slice` + `device_put`; callback: one
  `io_callback` returning a numpy slice): the bandwidth ceiling the row copies compare against.

Correctness: after the timed calls of every case the copied bytes are compared, byte-exact, with
numpy's expectation (copy: each written slot of each group's layers, gathered back from the
arena, against the pool rows' words; store: the host blocks against the source pages transposed
token-major; ref: the slab). The pool words are `random[r % 1024, c] ^ (r · 0x9E3779B1)`, so a
row or column sent to the wrong place cannot match. A mismatch prints `CORRECTNESS FAILURE`, is
recorded in the JSON, and the script exits 1 after finishing. A pattern the backend refuses (a
compile or run error) is a result, not a crash: the case's status says `error: …` and the errors
are listed at the end; if the scan over the stacked groups is refused, the copies are measured
with the groups unrolled (`groups_mode`) and the refusal is listed.

Run on the lent H200 (one call of under 5 minutes):

    set -o pipefail; PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/probe_host_gather.py \\
        --out $OUT --budget-s 220 2>&1 | tee $OUT/probe_host_gather_log.txt

with timeout_s ≈ 290: the budget counts from main's start (pool creation, a few seconds per GiB,
included; importing JAX and starting CUDA, ~10–20 s, not), and the last case started may run
another ~30 s (compile + warm-up + one call of up to `--max-call-s` + its check). Cases run in
priority order (references, stores, copies by growing B, then the other callback chunk sizes);
those the budget or `--max-call-s` leaves out are listed as skipped. `DIR/probe_host_gather.json`
is rewritten after every case, so a timeout keeps what finished. On a CPU, `--smoke` runs tiny
sizes in a few seconds (the numbers only show the script works):

    PYTHONPATH=. python scripts/probe_host_gather.py --smoke --out /tmp/probe

Pool size. `--pool-gib` (default 4 GiB: the pool is pinned host memory, made by `device_put` of a
numpy array to a `pinned_host` SingleDeviceSharding exactly as
`serving/hisparse/device_state.py::make_host_pool` does, and must fit the GPU pinned-host
allocator's default 64 GB cap). A larger pool needs `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` raised
before JAX starts the GPU backend; the script sets it (pool + 16 GiB) when `--pool-gib` > 48 and the
variable is unset, which works when it runs as a script (it has not started a backend yet). The
row-access pattern is uniform over the pool, so a larger pool mainly tests TLB/NUMA effects.

Reading the result to choose `kernels/host_rows/api.py::default_mechanism` (now "callback" on GPU,
"memory_kind" elsewhere, unmeasured): compare the two mechanisms' `step_ms` at the production
points (B = 32–64, miss 0.1–0.2, chunk 256). The script prints the per-point ratio
memory_kind / callback (< 1: memory_kind is faster) at every point both measured, and their
geometric mean as the `verdict` with the mechanism it favours. Also look at:
`us_per_iter` of memory_kind (≈ constant and ≥ a few µs means each loop iteration pays a host
round trip or a tiny DMA: the time grows with rows, not bytes); the callback's GB/s against its
`h2d_ref` (far below it means per-callback latency dominates: a larger chunk helps, see the other
chunk sizes); miss 0 (the fixed cost). A mechanism whose copy costs more than a few ms at B = 32,
miss 0.2 is a step-time problem whichever wins; compile_s says whether the unrolled/scanned loops
are a start-up cost worth noting. memory_kind cases predicted to take longer than `--max-call-s`
per call (default 8 s) are skipped and say so (that alone is an answer).

Device memory: the arena holds 1 + max(B) · hot-rows/64 pages, at least 1 + max(C) (13.6 GB at
B = 64 with the default 4096-row leases); the read-back for the checks adds ~100 MB. Host memory:
the pool twice (numpy for "callback" and the expectations, pinned for "memory_kind").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import io_callback  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

import kernels.host_rows.ops as host_ops  # noqa: E402
from glm53.config import preset  # noqa: E402
from kernels.host_rows import HostRowStore, copy_host_rows, default_mechanism, store_pages  # noqa: E402
from kernels.paged.layout import CacheComponent, GroupLayout  # noqa: E402
from kernels.paged.ops import gather_rows  # noqa: E402

warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")

TPP = 64  # MLA tokens per page (glm53/kv_layout.py)
ROW_KEY = 0x9E3779B1  # odd: r ↦ r·KEY mod 2³² is a bijection, so no two pool rows are equal
ENV_HOST_LIMIT = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PINNED_CAP_GIB = 48  # above this, raise the 64 GB pinned-host cap (leaves room for XLA's own use)

# Defaults of the flags left unset (pool size: 4 GiB, or 1024 rows with --smoke).
PRODUCTION = dict(batch="1,8,32,64", topk=2048, miss="0,0.1,0.2,0.4", store_pages="1,8,64", hot_rows=4096,
                  callback_chunks=f"{host_ops.CALLBACK_CHUNK},2048", groups=None, repeats=5, ref_mib=256,
                  readback_rows=2048)
SMOKE = dict(batch="1,4", topk=64, miss="0,0.25,0.5", store_pages="1,4", hot_rows=128,
             callback_chunks=f"{host_ops.CALLBACK_CHUNK},32", groups=5, repeats=3, ref_mib=1, readback_rows=64)


def _ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in str(s).split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/probe_host_gather", help="writes DIR/probe_host_gather.json")
    p.add_argument("--mechanisms", default=",".join(host_ops.MECHANISMS))
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new case past this (from main's start)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (5 groups, top-k 64) for a CPU check")
    p.add_argument("--batch", help="batch sizes B (default 1,8,32,64)")
    p.add_argument("--topk", type=int, help="top-k per request (default 2048)")
    p.add_argument("--miss", help="miss fractions (default 0,0.1,0.2,0.4; 0 = the loops' fixed cost)")
    p.add_argument("--store-pages", help="pages stored per step C (default 1,8,64)")
    p.add_argument("--pool-gib", type=float, help="host pool size in GiB (default 4; --smoke: 1024 rows)")
    p.add_argument("--pool-rows", type=int, help="host pool rows (overrides --pool-gib)")
    p.add_argument("--hot-rows", type=int, help="hot lease rows per request (default 4096 = (0+2)·2048)")
    p.add_argument("--callback-chunks", help="callback chunk sizes; the first is the main pass (default 256,2048)")
    p.add_argument("--groups", type=int, help="use the first N IndexShare groups of GLM-5.3 (default all 21)")
    p.add_argument("--repeats", type=int, help="timed calls per case after the warm-up (default 5)")
    p.add_argument("--case-s", type=float, default=6.0, help="fewer repeats when the warm-up says a case would "
                                                             "take longer than this")
    p.add_argument("--max-call-s", type=float, default=8.0, help="skip a case predicted to take longer per call")
    p.add_argument("--ref-mib", type=float, help="h2d reference slab (default 256 MiB)")
    p.add_argument("--readback-rows", type=int, help="rows per correctness read-back call (default 2048)")
    p.add_argument("--unrolled", action="store_true", help="unroll the stacked groups instead of lax.scan")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    base = SMOKE if args.smoke else PRODUCTION
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.pool_rows is None and args.pool_gib is None:
        if args.smoke:
            args.pool_rows = 1024
        else:
            args.pool_gib = 4.0
    args.mechanisms = [m for m in args.mechanisms.split(",") if m]
    for m in args.mechanisms:
        if m not in host_ops.MECHANISMS:
            p.error(f"unknown mechanism {m!r}; expected some of {host_ops.MECHANISMS}")
    args.batch, args.miss = _ints(args.batch), _floats(args.miss)
    args.store_pages, args.callback_chunks = _ints(args.store_pages), _ints(args.callback_chunks)
    if args.hot_rows % TPP or args.hot_rows < args.topk:
        p.error(f"--hot-rows must be a multiple of {TPP} and ≥ --topk")
    return args


# ---------------------------------------------------------------------------------- set-up
class Setup:
    """Layout, group plan, host pool(s) and the arena, shared by every case."""

    def __init__(self, args, t_start: float):
        self.args = args
        cfg = preset("glm-5.3")
        groups = cfg.index_groups if args.groups is None else cfg.index_groups[:args.groups]
        plan = cfg.layer_plan
        # The model runs the groups before the stacked tail one by one and scans the rest.
        self.groups = [(g[0], len(g)) for g in groups]
        self.head = [g for g in self.groups if g[0] < plan.stack_start]
        self.stacked = [g for g in self.groups if g[0] >= plan.stack_start]
        if args.unrolled or len({n for _, n in self.stacked}) > 1:
            self.head, self.stacked = self.groups, []
        self.copied_layers = sum(n for _, n in self.groups)
        if [f for f, _ in self.groups] != list(np.cumsum([0] + [n for _, n in self.groups])[:-1]):
            raise RuntimeError("the groups must cover layers 0… contiguously")
        self.pool_layers = self.copied_layers + cfg.num_mtp_layers
        comp = CacheComponent("mla", self.pool_layers, cfg.mla_row_width, "fp8_ds_mla", rope_dim=cfg.qk_rope_head_dim)
        self.layout = GroupLayout("mla", TPP, (comp,))
        self.W = comp.row_words
        self.row_words = self.pool_layers * self.W
        self.row_bytes = 4 * self.row_words
        self.layer_row_bytes = 4 * self.W
        self.page_bytes = 4 * self.layout.words_per_page

        if args.pool_rows is not None:
            rows = args.pool_rows
        else:
            rows = int(args.pool_gib * 2**30) // self.row_bytes
        self.pool_rows = rows // TPP * TPP
        self.num_host_blocks = self.pool_rows // TPP
        # Host blocks [store_start, end) take the store cases' pages (a region per C); copies read
        # only rows of blocks [1, store_start), so both mechanisms' pools keep numpy's contents there.
        self.store_start = self.num_host_blocks - sum(args.store_pages)
        self.read_rows = (self.store_start - 1) * TPP  # readable rows: [TPP, store_start·TPP)
        if self.read_rows < args.topk:
            raise SystemExit(f"pool of {self.pool_rows} rows too small for top-k {args.topk} "
                             f"(+{sum(args.store_pages)} store blocks)")
        self.device = jax.devices()[0]
        self.t_start = t_start

        t = time.perf_counter()
        rng = np.random.default_rng(args.seed)
        base = rng.integers(0, 2**32, size=(1024, self.row_words), dtype=np.uint32)
        key = (np.arange(self.pool_rows, dtype=np.uint64) * ROW_KEY % 2**32).astype(np.uint32)
        self.pool_np = np.empty((self.pool_rows, self.row_words), np.uint32)
        for i in range(0, self.pool_rows, 1024):
            j = min(self.pool_rows, i + 1024)
            np.bitwise_xor(base[:j - i], key[i:j, None], out=self.pool_np[i:j])
        self.pool_fill_s = time.perf_counter() - t

        self.store = None
        if "callback" in args.mechanisms:
            self.store = HostRowStore(1, self.row_words)
            self.store.rows = self.pool_np  # shares numpy's array (stores write only their region)
        self.pool = None
        self.pool_put_s = 0.0
        self.pool_error = None
        if "memory_kind" in args.mechanisms:
            t = time.perf_counter()
            try:
                sharding = SingleDeviceSharding(self.device, memory_kind="pinned_host")
                self.pool = jax.device_put(self.pool_np, sharding)  # as device_state.make_host_pool does
                jax.block_until_ready(self.pool)
                if jax.typeof(self.pool).memory_space != jax.memory.Space.Host:
                    raise RuntimeError(f"the host pool is typed {jax.typeof(self.pool)}, not host memory")
            except Exception as e:  # noqa: BLE001 — reported, and the memory_kind cases are dropped
                self.pool, self.pool_error = None, f"{type(e).__name__}: {str(e)[:400]}"
            self.pool_put_s = time.perf_counter() - t

        self.lease_pages = args.hot_rows // TPP
        self.num_blocks = 1 + max(max(args.batch) * self.lease_pages, max(args.store_pages))
        t = time.perf_counter()
        nb, pw = self.num_blocks, self.layout.words_per_page

        def fill():  # every word distinct (mod 2³²) and cheap to make: the store cases' source pages
            w = lax.broadcasted_iota(jnp.uint32, (nb, pw), 0) * jnp.uint32(pw)
            w = w + lax.broadcasted_iota(jnp.uint32, (nb, pw), 1)
            return w * jnp.uint32(ROW_KEY) ^ jnp.uint32(0x5BD1E995 + args.seed)

        self._fill_arena = jax.jit(fill, out_shardings=SingleDeviceSharding(self.device))
        self.arena = self._fill_arena()
        jax.block_until_ready(self.arena)
        self.arena_init_s = time.perf_counter() - t
        self._readback = None

    def recover(self) -> None:
        """After a failed call: remake a donated (deleted) arena or pinned pool so later cases run."""
        if self.arena.is_deleted():
            self.arena = self._fill_arena()
        if self.pool is not None and self.pool.is_deleted():
            self.pool = jax.device_put(self.pool_np, SingleDeviceSharding(self.device, memory_kind="pinned_host"))

    def pool_for(self, mechanism):
        return self.pool if mechanism == "memory_kind" else self.store

    def describe(self) -> dict:
        return dict(
            backend=jax.default_backend(), device=str(self.device), device_kind=self.device.device_kind,
            jax=jax.__version__, env_host_memory_limit_gb=os.environ.get(ENV_HOST_LIMIT),
            groups=self.groups, head_groups=len(self.head), stacked_groups=len(self.stacked),
            copied_layers=self.copied_layers, pool_layers=self.pool_layers, row_words_per_layer=self.W,
            layer_row_bytes=self.layer_row_bytes, host_row_bytes=self.row_bytes, pool_rows=self.pool_rows,
            pool_bytes=self.pool_rows * self.row_bytes, tokens_per_page=TPP, page_bytes=self.page_bytes,
            arena_blocks=self.num_blocks, arena_bytes=self.num_blocks * self.page_bytes,
            hot_rows_per_request=self.args.hot_rows, callback_chunk_module=host_ops.CALLBACK_CHUNK,
            pool_fill_s=round(self.pool_fill_s, 3), pool_put_s=round(self.pool_put_s, 3), pool_error=self.pool_error,
            arena_init_s=round(self.arena_init_s, 3))

    # ------------------------------------------------------------------ copy inputs
    def miss_lists(self, B: int, frac: float, rng) -> tuple[np.ndarray, np.ndarray, int]:
        """`rows, slots int32[G, B·K]` (valid first, −1 after) and the valid count per group."""
        K = self.args.topk
        G = len(self.groups)
        km = int(round(frac * K))
        rows = np.full((G, B * K), -1, np.int32)
        slots = np.full((G, B * K), -1, np.int32)
        for g in range(G):
            for b in range(B):
                r = rng.choice(self.read_rows, km, replace=False) + TPP
                s = rng.choice(self.args.hot_rows, km, replace=False) + (1 + b * self.lease_pages) * TPP
                rows[g, b * km:(b + 1) * km] = r
                slots[g, b * km:(b + 1) * km] = s
        return rows, slots, B * km

    def build_copy(self, mechanism: str, unrolled: bool = False):
        """One jitted step's copies: `copy_host_rows` for every group (stacked groups scanned)."""
        head, stacked, layout = self.head, self.stacked, self.layout
        if unrolled:
            head, stacked = self.groups, []

        def fn(arena, pool, rows_GX, slots_GX):
            for g, (first, n) in enumerate(head):
                arena = copy_host_rows(arena, pool, rows_GX[g], slots_GX[g], layout, "mla", first, n,
                                       mechanism=mechanism)
            if stacked:
                n = stacked[0][1]
                firsts = jnp.asarray([f for f, _ in stacked], jnp.int32)
                h = len(head)

                def body(a, xs):
                    first, r, s = xs
                    return copy_host_rows(a, pool, r, s, layout, "mla", first, n, mechanism=mechanism), None

                arena, _ = lax.scan(body, arena, (firsts, rows_GX[h:], slots_GX[h:]))
            return arena

        return jax.jit(fn, donate_argnums=(0,))

    def check_copy(self, arena, rows: np.ndarray, slots: np.ndarray, nv: int) -> str:
        """Byte-exact: every written slot's layers of each group against the pool rows' words."""
        if nv == 0:
            return "passed (nothing copied)"
        R = self.args.readback_rows
        if self._readback is None:
            groups, layout = self.groups, self.layout

            def rb(a, slots_GR):
                parts = [gather_rows(a, slots_GR[g], layout, "mla", first + li)
                         for g, (first, n) in enumerate(groups) for li in range(n)]
                return jnp.concatenate(parts, axis=-1)

            self._readback = jax.jit(rb)
        W = self.W
        for i0 in range(0, nv, R):
            i1 = min(nv, i0 + R)
            s = np.repeat(slots[:, :1], R, axis=1)
            s[:, :i1 - i0] = slots[:, i0:i1]
            got = np.asarray(self._readback(arena, s))[:i1 - i0]
            for g, (first, n) in enumerate(self.groups):
                want = self.pool_np[rows[g, i0:i1], first * W:(first + n) * W]
                have = got[:, first * W:(first + n) * W]
                if not np.array_equal(have, want):
                    bad = np.argwhere(have != want)
                    e, w = (int(x) for x in bad[0])
                    return (f"FAILED: group {g} (layers {first}..{first + n - 1}): {len(bad)} words differ; first "
                            f"at entry {i0 + e} (host row {rows[g, i0 + e]}, slot {slots[g, i0 + e]}), "
                            f"word {w}: got {have[e, w]:#x}, want {want[e, w]:#x}")
        return "passed"

    def read_pool_rows(self, mechanism: str, pool, r0: int, r1: int) -> np.ndarray:
        if mechanism == "callback":
            return self.store.rows[r0:r1].copy()
        if jax.default_backend() == "cpu":
            return np.asarray(jax.device_get(pool[r0:r1]))
        # Off the CPU an eager slice would be compute on a host operand (docs/design.md §4.3): fetch the
        # whole array (a plain host-to-host copy) and slice it here.
        return np.asarray(jax.device_get(pool))[r0:r1]


# ---------------------------------------------------------------------------------- runner
class Probe:
    def __init__(self, args):
        self.args = args
        self.t_start = time.perf_counter()
        self.results: list[dict] = []
        self.compiled: dict = {}
        self.est_s_per_row: dict[str, float] = {}
        self.scan_failed: dict[str, str] = {}  # mechanism → why the scanned groups did not compile
        self.copy_errors: dict[str, int] = {}  # mechanism → copy cases in a row that raised
        self.failures: list[str] = []  # correctness failures (the script exits 1)
        self.errors: list[str] = []  # refused patterns, exceptions: results, listed at the end
        self.meta: dict = {}
        self.path = None
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            self.path = os.path.join(args.out, "probe_host_gather.json")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def save(self) -> None:
        if self.path is None:
            return
        doc = dict(meta=self.meta, args={k: v for k, v in vars(self.args).items()}, results=self.results,
                   all_correct=not self.failures, failures=self.failures, errors=self.errors,
                   verdict=verdict(self.results),
                   elapsed_s=round(self.elapsed(), 2))
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def record(self, rec: dict) -> None:
        chk = rec.get("check", "")
        if chk.startswith("FAILED"):
            msg = f"{rec['kind']} {rec['mechanism']} {case_label(rec)}: {chk}"
            self.failures.append(msg)
            print(f"CORRECTNESS FAILURE: {msg}", file=sys.stderr, flush=True)
        elif rec.get("status", "").startswith("error"):
            msg = f"{rec['kind']} {rec['mechanism']} {case_label(rec)}: {rec['status']}"
            self.errors.append(msg)
            print(f"ERROR: {msg}", file=sys.stderr, flush=True)
        self.results.append(rec)
        print(row_text(rec), flush=True)
        self.save()

    def time_calls(self, call):
        """One warm-up call then up to `repeats` timed ones (fewer when the warm-up is long)."""
        t = time.perf_counter()
        call()
        warm = time.perf_counter() - t
        reps = max(1, min(self.args.repeats, int(self.args.case_s / max(warm, 1e-9))))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return warm, times

    def skip_reason(self, predicted_call_s: float | None, compile_guess: float = 0.0) -> str | None:
        left = self.args.budget_s - self.elapsed()
        if left <= 0:
            return "skipped: budget spent"
        if predicted_call_s is not None:
            if predicted_call_s > self.args.max_call_s:
                return f"skipped: predicted {predicted_call_s:.1f} s per call > --max-call-s"
            if compile_guess + 2 * predicted_call_s > left:
                return f"skipped: predicted {compile_guess + 2 * predicted_call_s:.1f} s > {left:.0f} s budget left"
        return None


def case_label(r: dict) -> str:
    if r["kind"] == "copy":
        return f"B={r['B']} miss={r['miss']}" + (f" chunk={r['chunk']}" if r.get("chunk") else "")
    if r["kind"] == "store":
        return f"C={r['pages']}"
    return f"{r.get('mib', '')} MiB"


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


HEADER = (f"{'kind':8} {'mechanism':11} {'case':24} {'rows/step':>9} {'MB/step':>9} {'step ms':>9} "
          f"{'rows/s':>9} {'GB/s':>7} {'us/iter':>8} {'compile s':>9}  check/status")


def row_text(r: dict) -> str:
    return (f"{r['kind']:8} {r['mechanism']:11} {case_label(r):24} {_fmt(r.get('rows'), 'd'):>9} "
            f"{_fmt(None if r.get('bytes') is None else r['bytes'] / 1e6, '.2f'):>9} "
            f"{_fmt(r.get('step_ms'), '.3f'):>9} {_fmt(r.get('rows_per_s'), '.3g'):>9} "
            f"{_fmt(r.get('gb_per_s'), '.3f'):>7} {_fmt(r.get('us_per_iter'), '.2f'):>8} "
            f"{_fmt(r.get('compile_s'), '.2f'):>9}  {r.get('check') or r.get('status', '')}")


def verdict(results: list[dict]) -> dict:
    """memory_kind / callback step-time ratios at the points both measured (main callback chunk)."""
    by = {}
    for r in results:
        if r["kind"] != "copy" or r.get("step_ms") is None or not r.get("miss"):
            continue
        if r["mechanism"] == "callback" and r.get("chunk") != r.get("main_chunk"):
            continue
        by.setdefault((r["B"], r["miss"]), {})[r["mechanism"]] = r["step_ms"]
    ratios = {f"B={b} miss={m}": v["memory_kind"] / v["callback"] for (b, m), v in sorted(by.items())
              if "memory_kind" in v and "callback" in v and v["callback"] > 0}
    if not ratios:
        return {"ratios_memory_kind_over_callback": {}, "suggested_default": None}
    gm = math.exp(sum(math.log(x) for x in ratios.values()) / len(ratios))
    return {"ratios_memory_kind_over_callback": {k: round(v, 3) for k, v in ratios.items()},
            "geomean_ratio": round(gm, 3), "suggested_default": "memory_kind" if gm < 1 else "callback",
            "backend": jax.default_backend()}


# ---------------------------------------------------------------------------------- cases
def run_h2d_ref(probe: Probe, su: Setup, mechanism: str) -> None:
    R = max(1, min(su.read_rows, int(probe.args.ref_mib * 2**20) // su.row_bytes))
    r0 = TPP
    rec = dict(kind="h2d_ref", mechanism=mechanism, rows=R, bytes=R * su.row_bytes, mib=probe.args.ref_mib)
    reason = probe.skip_reason(None)
    if reason:
        probe.record({**rec, "status": reason})
        return
    try:
        if mechanism == "memory_kind":
            fn = jax.jit(lambda p, r: jax.device_put(lax.dynamic_slice(p, (r, 0), (R, su.row_words)),
                                                     jax.memory.Space.Device))
            args = (su.pool, jnp.int32(r0))
        else:
            pool_np = su.pool_np
            fn = jax.jit(lambda r: io_callback(lambda rr: pool_np[int(rr):int(rr) + R],
                                               jax.ShapeDtypeStruct((R, su.row_words), jnp.uint32), r,
                                               ordered=False))
            args = (jnp.int32(r0),)
        t = time.perf_counter()
        comp = fn.lower(*args).compile()
        compile_s = time.perf_counter() - t
        out = {}

        def call():
            out["x"] = comp(*args)
            jax.block_until_ready(out["x"])

        warm, times = probe.time_calls(call)
        ok = np.array_equal(np.asarray(out["x"]), su.pool_np[r0:r0 + R])
        med = float(np.median(times))
        probe.record({**rec, "compile_s": compile_s, "warmup_s": warm, "times_s": times, "step_ms": med * 1e3,
                      "gb_per_s": rec["bytes"] / med / 1e9, "rows_per_s": R / med,
                      "check": "passed" if ok else "FAILED: slab differs from the pool rows", "status": "ok"})
        del out
    except Exception as e:  # noqa: BLE001 — a refused pattern is a result
        probe.record({**rec, "status": f"error: {type(e).__name__}: {str(e)[:400]}"})


def run_store(probe: Probe, su: Setup, mechanism: str, C: int, region_start: int, rng) -> None:
    args = probe.args
    Cmax = max(args.store_pages)
    rec = dict(kind="store", mechanism=mechanism, pages=C, rows=C * TPP, bytes=C * su.page_bytes)
    key = ("store", mechanism)
    reason = probe.skip_reason(None)
    if reason:
        probe.record({**rec, "status": reason})
        return
    try:
        compile_s = None
        if key not in probe.compiled:
            def fn(pool, arena, src, dst):
                return store_pages(pool, arena, src, dst, su.layout, "mla", mechanism=mechanism)

            jf = jax.jit(fn, donate_argnums=(0,) if mechanism == "memory_kind" else ())
            src0 = jnp.zeros((Cmax,), jnp.int32)
            t = time.perf_counter()
            probe.compiled[key] = jf.lower(su.pool_for(mechanism), su.arena, src0, src0 - 1).compile()
            compile_s = time.perf_counter() - t
        comp = probe.compiled[key]
        src = np.zeros(Cmax, np.int32)
        dst = np.full(Cmax, -1, np.int32)
        src[:C] = rng.choice(np.arange(1, su.num_blocks), C, replace=False)
        dst[:C] = np.arange(region_start, region_start + C)
        src_d, dst_d = jax.device_put(src, su.device), jax.device_put(dst, su.device)
        done = {}

        def call():
            pool, n = comp(su.pool_for(mechanism), su.arena, src_d, dst_d)
            if mechanism == "memory_kind":
                su.pool = pool
            jax.block_until_ready((pool, n) if mechanism == "memory_kind" else n)
            done["n"] = int(n)

        warm, times = probe.time_calls(call)
        med = float(np.median(times))
        # Expectation: the source pages, token-major ([L, tpp, W] → [tpp, L·W]).
        pages = np.asarray(su.arena[jnp.asarray(src[:C])])[:, :su.pool_layers * TPP * su.W]
        want = pages.reshape(C, su.pool_layers, TPP, su.W).transpose(0, 2, 1, 3).reshape(C * TPP, su.row_words)
        have = su.read_pool_rows(mechanism, su.pool, region_start * TPP, (region_start + C) * TPP)
        if done["n"] != C:
            check = f"FAILED: store_pages reported {done['n']} pages, expected {C}"
        elif not np.array_equal(have, want):
            bad = np.argwhere(have != want)
            check = (f"FAILED: {len(bad)} words differ; first at host row {region_start * TPP + bad[0][0]}, "
                     f"word {bad[0][1]}")
        else:
            check = "passed"
        probe.record({**rec, "compile_s": compile_s, "warmup_s": warm, "times_s": times, "step_ms": med * 1e3,
                      "gb_per_s": rec["bytes"] / med / 1e9, "rows_per_s": C * TPP / med,
                      "us_per_iter": med / C * 1e6, "check": check, "status": "ok"})
    except Exception as e:  # noqa: BLE001 — a refused pattern is a result
        su.recover()
        probe.record({**rec, "status": f"error: {type(e).__name__}: {str(e)[:400]}"})


def run_copy(probe: Probe, su: Setup, mechanism: str, B: int, frac: float, chunk: int | None, rng) -> None:
    args = probe.args
    K = args.topk
    km = int(round(frac * K))
    G = len(su.groups)
    host_rows = B * km * G  # host rows read (each: a group's layers of one token)
    layer_rows = B * km * su.copied_layers
    nbytes = layer_rows * su.layer_row_bytes
    X = B * K
    if mechanism == "callback":
        c_eff = min(chunk, X)
        iters = G * math.ceil(B * km / c_eff)
    else:
        iters = host_rows
    rec = dict(kind="copy", mechanism=mechanism, B=B, topk=K, miss=frac, chunk=chunk,
               main_chunk=args.callback_chunks[0] if mechanism == "callback" else None,
               misses_per_request_per_group=km, rows=host_rows, layer_rows=layer_rows, bytes=nbytes,
               loop_iterations=iters)
    unrolled = probe.args.unrolled or mechanism in probe.scan_failed or not su.stacked
    rec["groups_mode"] = "unrolled" if unrolled else "scan"
    key = ("copy", mechanism, B, chunk, unrolled)
    est = probe.est_s_per_row.get(mechanism)
    pred = est * host_rows if (est is not None and host_rows) else None
    compile_guess = 0.0 if key in probe.compiled else max(
        [r.get("compile_s") or 0.0 for r in probe.results if r["kind"] == "copy" and r["mechanism"] == mechanism],
        default=0.0)
    reason = probe.skip_reason(pred, compile_guess)
    if probe.copy_errors.get(mechanism, 0) >= 3:
        reason = "skipped: the last 3 copy cases of this mechanism raised"
    if reason:
        probe.record({**rec, "status": reason, "predicted_call_s": pred})
        return
    try:
        pool = su.pool_for(mechanism)
        compile_s = None
        if key not in probe.compiled:
            old = host_ops.CALLBACK_CHUNK
            try:
                if chunk is not None:
                    host_ops.CALLBACK_CHUNK = chunk  # read by copy_host_rows while tracing
                z = jnp.zeros((G, X), jnp.int32)
                t = time.perf_counter()
                try:
                    probe.compiled[key] = su.build_copy(mechanism, unrolled).lower(su.arena, pool, z, z).compile()
                except Exception as e:  # noqa: BLE001
                    if unrolled:
                        raise
                    # The production shape (a scan over the stacked groups) was refused: say so
                    # and measure the unrolled groups instead, for this and every later case.
                    probe.scan_failed[mechanism] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"ERROR: {mechanism}: the scanned groups do not compile ({probe.scan_failed[mechanism]});"
                          " falling back to unrolled groups", file=sys.stderr, flush=True)
                    probe.errors.append(f"copy {mechanism}: scan over the stacked groups refused: "
                                          f"{probe.scan_failed[mechanism]}")
                    unrolled = True
                    rec["groups_mode"] = "unrolled (scan refused)"
                    key = ("copy", mechanism, B, chunk, True)
                    t = time.perf_counter()
                    probe.compiled[key] = su.build_copy(mechanism, True).lower(su.arena, pool, z, z).compile()
                compile_s = time.perf_counter() - t
            finally:
                host_ops.CALLBACK_CHUNK = old
        comp = probe.compiled[key]
        rows, slots, nv = su.miss_lists(B, frac, rng)
        rows_d, slots_d = jax.device_put(rows, su.device), jax.device_put(slots, su.device)

        def call():
            su.arena = comp(su.arena, pool, rows_d, slots_d)
            jax.block_until_ready(su.arena)

        warm, times = probe.time_calls(call)
        med = float(np.median(times))
        check = su.check_copy(su.arena, rows, slots, nv)
        probe.copy_errors[mechanism] = 0
        if host_rows:
            probe.est_s_per_row[mechanism] = max(warm, med) / host_rows
        probe.record({**rec, "compile_s": compile_s, "warmup_s": warm, "times_s": times, "step_ms": med * 1e3,
                      "rows_per_s": host_rows / med if host_rows else None,
                      "gb_per_s": nbytes / med / 1e9 if host_rows else None,
                      "us_per_iter": med / iters * 1e6 if iters else None, "check": check, "status": "ok"})
    except Exception as e:  # noqa: BLE001 — a refused pattern is a result
        su.recover()
        probe.copy_errors[mechanism] = probe.copy_errors.get(mechanism, 0) + 1
        probe.record({**rec, "status": f"error: {type(e).__name__}: {str(e)[:400]}"})


# ---------------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    probe = Probe(args)
    pool_gib = args.pool_gib if args.pool_rows is None else args.pool_rows * 79 * 656 / 2**30  # upper bound
    if pool_gib > PINNED_CAP_GIB and ENV_HOST_LIMIT not in os.environ:
        os.environ[ENV_HOST_LIMIT] = str(int(math.ceil(pool_gib)) + 16)
        print(f"set {ENV_HOST_LIMIT}={os.environ[ENV_HOST_LIMIT]} (only effective before JAX starts its GPU backend)")
    su = Setup(args, probe.t_start)
    probe.meta = su.describe()
    if su.pool_error:
        msg = f"memory_kind: the pinned_host pool could not be made ({su.pool_error}); its cases are skipped"
        print(f"ERROR: {msg}", file=sys.stderr, flush=True)
        probe.errors.append(msg)
        args.mechanisms = [m for m in args.mechanisms if m != "memory_kind"]
    m = probe.meta
    print(f"backend {m['backend']} ({m['device_kind']}), jax {m['jax']}; groups {len(su.groups)} "
          f"({m['head_groups']} head + {m['stacked_groups']} scanned), {su.copied_layers} copied layers, "
          f"pool rows of {su.pool_layers} layers × {su.W} words = {su.row_bytes} B; pool {su.pool_rows} rows "
          f"({m['pool_bytes'] / 2**30:.2f} GiB, fill {su.pool_fill_s:.1f} s, pinned put {su.pool_put_s:.1f} s); "
          f"arena {su.num_blocks} pages × {su.page_bytes / 1e6:.2f} MB", flush=True)
    print(HEADER, flush=True)
    probe.save()
    rng = np.random.default_rng(args.seed + 1)

    for mech in args.mechanisms:
        run_h2d_ref(probe, su, mech)
    region = su.store_start
    for C in sorted(args.store_pages):
        for mech in args.mechanisms:
            run_store(probe, su, mech, C, region, rng)
        region += C
    main_chunk, *other_chunks = args.callback_chunks
    for B in sorted(args.batch):
        for mech in args.mechanisms:
            for frac in sorted(args.miss):
                run_copy(probe, su, mech, B, frac, main_chunk if mech == "callback" else None, rng)
    if "callback" in args.mechanisms:
        for chunk in other_chunks:
            for B in sorted(args.batch):
                for frac in sorted(f for f in args.miss if f > 0):
                    run_copy(probe, su, "callback", B, frac, chunk, rng)

    probe.save()
    print("\n" + HEADER)
    for r in probe.results:
        print(row_text(r))
    v = verdict(probe.results)
    print(f"\nverdict ({jax.default_backend()}): memory_kind/callback step-time ratios "
          f"{v['ratios_memory_kind_over_callback']}; geomean {v.get('geomean_ratio')}; "
          f"suggested default: {v['suggested_default']} "
          f"(kernels/host_rows/api.py::default_mechanism now: {default_mechanism()})")
    if probe.errors:
        print(f"\n{len(probe.errors)} ERROR(S) (refused or failed cases):\n  " + "\n  ".join(probe.errors),
              file=sys.stderr)
    if probe.failures:
        print(f"\n{len(probe.failures)} CORRECTNESS FAILURE(S):\n  " + "\n  ".join(probe.failures),
              file=sys.stderr)
    else:
        print("all correctness checks passed")
    print(f"total {probe.elapsed():.1f} s" + (f"; results in {probe.path}" if probe.path else ""))
    return dict(meta=probe.meta, results=probe.results, all_correct=not probe.failures, failures=probe.failures,
                errors=probe.errors, verdict=v)


if __name__ == "__main__":
    sys.exit(0 if main()["all_correct"] else 1)
