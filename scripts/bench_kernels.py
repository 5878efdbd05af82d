"""Kernel benchmark: sparse MLA, the indexer top-k and the FP8 weight matmuls on the available
backend, against the roofline.

    PYTHONPATH=. python scripts/bench_kernels.py --out /tmp/bench        # whatever backend is there
    PYTHONPATH=. python scripts/bench_kernels.py --out /tmp/bench --smoke       # GPU plan, tiny, interpret mode
    PYTHONPATH=. python scripts/bench_kernels.py --out /tmp/bench --sections fp8  # the FP8 matmuls only

On the lent H200 (one call; ~7 minutes):
    set -o pipefail; PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/bench_kernels.py --out $OUT --budget-s 400 \
        2>&1 | tee $OUT/bench_log.txt

On a GPU it runs the Pallas kernels (`implementation="pallas_triton"`) at production shapes on the
production cache format (`--kv-cache-dtype fp8`): sparse-MLA decode on `fp8_ds_mla` rows (656 B:
512 e4m3 latent + 4 fp32 tile scales + 64 bf16 rope) with 8 and 64 heads (TP8 / PCP), top-k
2048, batch 1–128, a prefill point, a small launch-parameter sweep; the indexer (32 heads × 128)
on `fp8_per_token_hadamard` keys (132 B) at decode over contexts 8K–1M and batch 1–128, plus a
scores-only diagnostic. A second, shorter pass repeats the main decode points on bf16 rows
(1152 B latent rows, 256 B keys). It first measures
the device-to-device copy bandwidth and checks each kernel against the reference on the device.
On CPU it runs the references at small shapes (the numbers only show the script works).

Everything it prints is computed here: the roofline of docs/design.md §9 comes from `glm53.capacity`
(row bytes from the cache format, FLOPs from the widths), the H200 ridge from the datasheet peak
and bandwidth below, achieved rates from the bytes and FLOPs each call must move and do over its
median wall time. Cases run in priority order and stop at `--budget-s` (those left are listed as
skipped), so one call fits a time limit. Results: `DIR/bench_kernels.json`.

Bytes counted per call (what the op must read and write once): sparse MLA: K rows of the cache
format + a 4-byte slot per row per token, the queries, o_lat (fp32) and lse; indexer: (pos+1) key
rows + one 4-byte block-table entry per page per token, queries, weights and the top-k output.
FLOPs: sparse MLA 2·(A+R) + 2·A per row per head (QK and PV); indexer 2·I·Dk + 3·I per key.

FP8 section (`--sections fp8`; GPU only — on a machine without one it prints that it is skipped,
`--smoke` runs its code paths in interpret mode): the block-scaled FP8 weight matmuls of
`kernels.fp8_matmul` (W8A16 Pallas kernels, block 128 × 128) at GLM-5.3 shapes — q_b_proj TP8
[2048, 2048], kv_a_proj [6144, 576], o_proj TP8 [2048, 6144] at decode M = 1, 8, 32, 128 and
prefill M = 4096; the MoE experts (256 / EP8 = 32 per rank) gate/up [32, 6144, 2048] and down
[32, 2048, 6144] over 64, 1024 and 4096 routed rows — against XLA's bf16 dot with bf16 weights of
the same shape (`jnp.dot`, `lax.ragged_dot`) and the fp8 reference (dequantise, then dot). Bytes:
the weight (fp8 + fp32 scales, or bf16; grouped: only experts that receive rows), x (bf16) and the
output; FLOPs 2·M·K·N. Roofline fractions use the bf16 tensor-core peak for the W8A16 kernels and
the bf16 dots (`roofline_fraction`) and, as a lead for a W8A8 kernel, the FP8 peak
(`fp8_roofline_fraction`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from glm53 import capacity as cap  # noqa: E402
from glm53.config import preset  # noqa: E402
from kernels.indexer_topk.pallas_triton import indexer_topk_pallas_triton  # noqa: E402
from kernels.indexer_topk.reference import indexer_topk_reference  # noqa: E402
from kernels.paged import CacheComponent, GroupLayout, encode_rows, to_key_basis  # noqa: E402
from kernels.pallas_rows import key_row_codec, to_lanes  # noqa: E402
from kernels.sparse_mla.pallas_triton import sparse_mla_pallas_triton  # noqa: E402
from kernels.sparse_mla.reference import sparse_mla_reference  # noqa: E402

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

# H200 SXM datasheet figures (leads, not measurements): dense bf16 tensor-core peak and HBM3e bandwidth.
H200_BF16_FLOPS = 989e12
H200_FP8_FLOPS = 1979e12
H200_HBM_BYTES_S = 4.8e12
TPP = 64  # tokens per page (docs/design.md §4.1)
MLA_FP8, KEY_FP8 = "fp8_ds_mla", "fp8_per_token_hadamard"  # what --kv-cache-dtype fp8 stores


# ----------------------------------------------------------------------------- roofline from code

def roofline_summary(cfg) -> dict:
    """docs/design.md §9's roofline facts computed from the model config and the cache formats."""
    out = {"ridge_flops_per_byte": H200_BF16_FLOPS / H200_HBM_BYTES_S,
           "peak_bf16_flops": H200_BF16_FLOPS, "hbm_bytes_s": H200_HBM_BYTES_S}
    for heads in (8, 64):
        for kv in ("fp8", "bf16"):
            rl = cap.sparse_mla_roofline(cfg, heads, kv)
            out[f"sparse_mla_{kv}_{heads}h"] = {
                "row_bytes": rl.row_bytes, "head_bytes": rl.head_bytes, "flops_per_row_head": rl.flops_per_row_head,
                "bytes_per_token": rl.bytes, "flops_per_token": rl.flops, "intensity": rl.intensity,
                "bound": "memory" if rl.intensity < out["ridge_flops_per_byte"] else "compute"}
    I, Dk = cfg.index_n_heads, cfg.index_head_dim
    for kv in ("fp8", "bf16"):
        key = cap.indexer_row_bytes(cfg, kv) + cap.INDEX_BYTES / TPP
        flops = 2 * I * Dk + 3 * I
        out[f"indexer_{kv}"] = {"bytes_per_key": key, "flops_per_key": flops, "intensity": flops / key}
    return out


def print_roofline(r: dict):
    print(f"H200 ridge: {r['peak_bf16_flops'] / 1e12:.0f} TFLOP/s / {r['hbm_bytes_s'] / 1e12:.1f} TB/s "
          f"= {r['ridge_flops_per_byte']:.0f} FLOP/B")
    for k, v in r.items():
        if k.startswith("sparse_mla"):
            print(f"  {k:22s} row {v['row_bytes']} B, per head {v['head_bytes']} B and {v['flops_per_row_head']} "
                  f"FLOP/row → {v['bytes_per_token'] / 1e6:.2f} MB, {v['flops_per_token'] / 1e6:.1f} MFLOP per "
                  f"token, {v['intensity']:.0f} FLOP/B ({v['bound']}-bound)")
        elif k.startswith("indexer"):
            print(f"  {k:22s} {v['bytes_per_key']:.2f} B and {v['flops_per_key']} FLOP per key → "
                  f"{v['intensity']:.0f} FLOP/B")


# ----------------------------------------------------------------------------- timing

def timed(fn, *args, min_s=0.05, rounds=5):
    """Median seconds per call (after a compile call and a warm-up), dispatching back to back."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(50, max(1, min_s / one)))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / reps)
    return float(np.median(ts)), compile_s


def copy_bandwidth(nbytes: int) -> float:
    """Device copy rate, bytes read + written per second (a measured ceiling)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    t, _ = timed(f, x, rounds=5)
    return 2 * nbytes / t


# ----------------------------------------------------------------------------- data

def one_layer_pages(vals, lay: GroupLayout, comp: CacheComponent):
    """Values `[nb, TPP, W]` → the pages `uint32[nb, words_per_page]` of a one-component, one-layer
    group: each row segment of all the page's tokens in turn (fp8 keys: all codes, then all scales)."""
    words = encode_rows(vals, comp.row_dtype, comp.rope_dim)  # logical rows [nb, TPP, row_words]
    parts, off = [], 0
    for n in comp.segments:
        parts.append(words[..., off:off + n].reshape(vals.shape[0], TPP * n))
        off += n
    return jnp.concatenate(parts, axis=-1)


def mla_arena(key, rows: int, A: int, R: int, row_dtype: str):
    """A one-layer MLA group of `rows` random rows (+ the null block) → (layout, arena)."""
    comp = CacheComponent("mla", 1, A + R, row_dtype, rope_dim=R if row_dtype == "fp8_ds_mla" else 0)
    lay = GroupLayout("mla", TPP, (comp,))
    nb = rows // TPP + 1
    vals = jax.random.normal(key, (nb, TPP, A + R), jnp.float32)
    return lay, one_layer_pages(vals, lay, comp)


def index_arena(key, pages: int, Dk: int, row_dtype: str, integer=False):
    """Indexer keys. `integer`: entries in [−2, 2] plus one ±7 per key, which every key format
    (fp8 included: scale 7/448 = 2^-6, codes 64·x) stores exactly, so with integer queries all
    scores are exact in fp32 (Pallas and reference selections must then be identical). The
    Hadamard format rotates keys before quantising, so its integer keys are not exact."""
    comp = CacheComponent("indexer", 1, Dk, row_dtype)
    lay = GroupLayout("idx", TPP, (comp,))
    nb = pages + 1
    if integer:
        k1, k2, k3 = jax.random.split(key, 3)
        vals = jax.random.randint(k1, (nb, TPP, Dk), -2, 3).astype(jnp.float32)
        hot = jax.nn.one_hot(jax.random.randint(k2, (nb, TPP), 0, Dk), Dk, dtype=jnp.bool_)
        sign = jnp.where(jax.random.bernoulli(k3, 0.5, (nb, TPP, 1)), 7.0, -7.0)
        vals = jnp.where(hot, sign, vals)
    else:
        vals = jax.random.normal(key, (nb, TPP, Dk), jnp.float32)
    return lay, one_layer_pages(vals, lay, comp)


# ----------------------------------------------------------------------------- cases

class Bench:
    """Runs cases in order until the time budget is spent; rewrites the JSON after every case, so a
    run cut short (a crash, a time limit) still leaves its results."""

    def __init__(self, budget_s: float, hbm: float, peak: float, path: str | None = None, header: dict | None = None):
        self.path, self.header = path, header or {}
        self.t_start = time.perf_counter()
        self.budget_s = budget_s
        self.hbm, self.peak = hbm, peak
        self.records: list[dict] = []
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t_start)

    def run(self, name: str, fn, args, nbytes: float, flops: float, **meta):
        if self.left() <= 0:
            self.skipped.append(name)
            return None
        try:
            t, compile_s = timed(fn, *args)
        except Exception as e:  # noqa: BLE001 — record and keep going: one call must finish
            rec = {"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}", **meta}
            print(f"  {name:58s} ERROR {rec['error'][:150]}")
            self.records.append(rec)
            self.save()
            return rec
        floor = max(nbytes / self.hbm, flops / self.peak)
        rec = {"name": name, "seconds": t, "compile_s": compile_s, "bytes": nbytes, "flops": flops,
               "peak_flops": self.peak,
               "bytes_per_s": nbytes / t, "flops_per_s": flops / t, "hbm_fraction": nbytes / t / self.hbm,
               "roofline_fraction": floor / t, **meta}
        print(f"  {name:58s} {t * 1e6:10.1f} us {nbytes / t / 1e9:8.1f} GB/s {flops / t / 1e12:7.2f} TFLOP/s "
              f"{100 * rec['hbm_fraction']:5.1f}% BW {100 * rec['roofline_fraction']:5.1f}% roof")
        self.records.append(rec)
        self.save()
        return rec

    def save(self):
        if self.path:
            with open(self.path, "w") as f:
                json.dump({**self.header, "records": self.records, "skipped": self.skipped}, f, indent=1, default=float)


def sparse_mla_case(bench, key, lay, arena, *, T, N, K, A, R, impl, q_dtype=jnp.bfloat16, label="", **kw):
    k1, k2 = jax.random.split(key)
    rows = (arena.shape[0] - 1) * TPP
    q = jax.random.normal(k1, (T, N, A + R), jnp.float32).astype(q_dtype)
    slots = jax.random.randint(k2, (T, K), TPP, (rows + TPP), dtype=jnp.int32)
    _, comp = lay.component("mla")
    row_bytes = 4 * comp.row_words
    nbytes = T * K * (row_bytes + 4) + T * N * ((A + R) * jnp.dtype(q_dtype).itemsize + 4 * A + 4)
    flops = T * N * K * (2 * (A + R) + 2 * A)
    common = dict(layout=lay, component="mla", kv_lora_rank=A, scale=(A + R) ** -0.5)
    if impl == "xla":
        fn = jax.jit(lambda q, a, s: sparse_mla_reference(q, a, s, 0, **common))
    else:
        fn = jax.jit(lambda q, a, s: sparse_mla_pallas_triton(q, a, s, 0, **common, **kw))
    prec = f" {kw['precision']}" if "precision" in kw else ""
    name = f"sparse_mla {impl}{prec} {comp.row_dtype} T={T} N={N} K={K} {label}".strip()
    return bench.run(name, fn, (q, arena, slots), nbytes, flops, op="sparse_mla", impl=impl, T=T, N=N, K=K,
                     row_dtype=comp.row_dtype, config={k: v for k, v in kw.items()}, label=label)


def indexer_case(bench, key, *, B, S, I, Dk, K, row_dtype, impl, max_tokens, label="", **kw):
    """B decode queries, each at position S−1 of its own request (pages shared only above
    `max_tokens` distinct cached tokens)."""
    P = -(-S // TPP)
    pages = min(B * P, max(P, max_tokens // TPP))
    k1, k2, k3, k4 = jax.random.split(key, 4)
    lay, arena = index_arena(k1, pages, Dk, row_dtype)
    bt = (jax.random.permutation(k2, B * P) % pages + 1).astype(jnp.int32).reshape(B, P)
    q = jax.random.normal(k3, (B, I, Dk), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k4, (B, I), jnp.float32) * I ** -0.5
    req = jnp.arange(B, dtype=jnp.int32)
    pos = jnp.full((B,), S - 1, jnp.int32)
    _, comp = lay.component("indexer")
    nbytes = B * S * (4 * comp.row_words) + B * P * 4 + B * (I * Dk * 2 + I * 4 + K * 4 + 4)
    flops = B * S * (2 * I * Dk + 3 * I)
    common = dict(layout=lay, component="indexer", topk=K)
    if impl == "xla":
        fn = jax.jit(lambda *a: indexer_topk_reference(*a, 0, **common))
    else:
        fn = jax.jit(lambda *a: indexer_topk_pallas_triton(*a, 0, **common, **kw))
    prec = f" {kw['precision']}" if "precision" in kw else ""
    name = f"indexer {impl}{prec} {row_dtype} B={B} S={S} {label}".strip()
    rec = bench.run(name, fn, (q, w, arena, bt, req, pos), nbytes, flops, op="indexer_topk", impl=impl, B=B, S=S,
                    row_dtype=row_dtype, distinct_pages=pages == B * P, config=dict(kw), label=label)
    del arena
    return rec


def indexer_scores_only(bench, key, *, B, S, I, Dk, row_dtype, block_s=128, precision="bf16", interpret=False):
    """Diagnostic: the Pallas score kernel alone over all S keys in one launch (no top-k merge)."""
    from kernels.indexer_topk.pallas_triton import chunk_scores
    P = -(-S // TPP)
    k1, k2, k3 = jax.random.split(key, 3)
    lay, arena = index_arena(k1, B * P, Dk, row_dtype)
    _, comp = lay.component("indexer")
    bt = (jax.random.permutation(k2, B * P) + 1).astype(jnp.int32).reshape(B, P)
    q = jax.random.normal(k3, (B, I, Dk), jnp.float32).astype(jnp.bfloat16)
    w = jnp.ones((B, I), jnp.float32)
    req = jnp.arange(B, dtype=jnp.int32)
    pos = jnp.full((B,), S - 1, jnp.int32)

    def f(q, w, arena, bt, req, pos):
        lanes = to_lanes(to_key_basis(q, row_dtype).astype(q.dtype), key_row_codec(row_dtype, Dk).part_lanes[0])
        return chunk_scores(lanes, w, req, pos, bt, arena, jnp.zeros((1,), jnp.int32),
                            jnp.int32(0), layout=lay, comp=comp, s_chunk=P * TPP, block_s=block_s, num_warps=4,
                            num_stages=2, precision=precision, interpret=interpret)

    nbytes = B * S * (4 * comp.row_words + 4) + B * P * 4  # keys, fp32 scores out, block table
    flops = B * S * (2 * I * Dk + 3 * I)
    return bench.run(f"indexer scores-only pallas {row_dtype} B={B} S={S} block_s={block_s}", jax.jit(f),
                     (q, w, arena, bt, req, pos), nbytes, flops, op="indexer_scores", impl="pallas_triton", B=B, S=S,
                     row_dtype=row_dtype)


# ----------------------------------------------------------------------------- device checks

def check_on_device(cfg, small=False) -> dict:
    """Pallas vs reference on this device at moderate shapes (sparse MLA: max relative error;
    indexer: exact equality on integer-valued data, whose dots are exact in fp32). `small`
    (--smoke, interpret mode): the production row formats only — the code path is the same for
    every format, and tests/kernels checks each format's interpret-mode kernel already."""
    A, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out = {}
    key = jax.random.PRNGKey(1)
    for row_dtype in (MLA_FP8,) if small else (MLA_FP8, "bfloat16", "float32"):
        rows, K, N = (1 << 12, 64, 16) if small else (1 << 16, 2048, 64)
        lay, arena = mla_arena(key, rows, A, R, row_dtype)
        q = jax.random.normal(key, (4, N, A + R), jnp.float32)
        slots = jax.random.randint(jax.random.PRNGKey(2), (4, K), TPP, rows + TPP, dtype=jnp.int32)
        slots = slots.at[1, K // 2:].set(-1).at[2].set(-1)  # a short row and an empty row
        kw = dict(layout=lay, component="mla", kv_lora_rank=A, scale=(A + R) ** -0.5)
        o_r, l_r = sparse_mla_reference(q, arena, slots, 0, **kw)
        for precision in ("highest", "bf16"):
            try:
                o_p, l_p = sparse_mla_pallas_triton(q, arena, slots, 0, **kw, precision=precision, interpret=small)
                err = float(jnp.max(jnp.abs(o_p - o_r)) / jnp.max(jnp.abs(o_r)))
                lse_ok = bool(jnp.all(jnp.isneginf(l_p[2])) and not jnp.any(jnp.isnan(l_p)))
                lse_err = float(jnp.max(jnp.where(jnp.isfinite(l_r), jnp.abs(l_p - l_r), 0.0)))
                out[f"sparse_mla {row_dtype} {precision}"] = {"o_rel_err": err, "lse_abs_err": lse_err,
                                                              "empty_row_ok": lse_ok}
            except Exception as e:  # noqa: BLE001
                out[f"sparse_mla {row_dtype} {precision}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    I, Dk = cfg.index_n_heads, cfg.index_head_dim
    for row_dtype in (KEY_FP8,) if small else ("fp8_per_token", "bfloat16", KEY_FP8):
        lay, arena = index_arena(key, 256, Dk, row_dtype, integer=True)
        B, P = 4, 128
        bt = (jax.random.permutation(key, 256)[: B * P // 2] + 1).astype(jnp.int32)
        bt = jnp.concatenate([bt, bt]).reshape(B, P)
        q = jax.random.randint(key, (B, I, Dk), -2, 3).astype(jnp.float32)
        w = jax.random.randint(jax.random.PRNGKey(3), (B, I), -2, 3).astype(jnp.float32)
        req = jnp.arange(B, dtype=jnp.int32)
        pos = jnp.array([300, 200, 100, 3] if small else [8191, 5000, 1000, 3], jnp.int32)
        args = (q, w, arena, bt, req, pos, 0)
        topk = 64 if small else 2048
        ref = indexer_topk_reference(*args, layout=lay, component="indexer", topk=topk, return_scores=True)
        try:
            got = indexer_topk_pallas_triton(*args, layout=lay, component="indexer", topk=topk, interpret=small,
                                             return_scores=True, **({"s_chunk": 256} if small else {}))
            fin = jnp.isfinite(ref[2])
            rec = {"identical": bool(jnp.array_equal(got[0], ref[0]) and jnp.array_equal(got[1], ref[1])),
                   "score_max_abs_err": float(jnp.max(jnp.where(fin, jnp.abs(got[2] - ref[2]), 0.0))),
                   "same_sets_fraction": float(jnp.mean(jnp.array([
                       jnp.array_equal(jnp.sort(got[0][b]), jnp.sort(ref[0][b])) for b in range(B)])))}
            if row_dtype == KEY_FP8:  # rotated keys are not exact: only rounding-level score differences
                rec["note"] = "rotated fp8 keys are not exact in fp32; selections may differ at near-ties"
            out[f"indexer {row_dtype}"] = rec
        except Exception as e:  # noqa: BLE001
            out[f"indexer {row_dtype}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for k, v in out.items():
        print(f"  check {k:32s} {v}")
    return out


# ----------------------------------------------------------------------------- plans

FULL = dict(mla_rows=1 << 20, K=None, mla_decode=((64, (32, 128, 64, 1, 8)), (8, (32, 128, 64, 1, 8))),
            idx_decode=((32, 131072), (128, 8192), (1, 1 << 20), (32, 8192), (128, 131072), (1, 8192), (8, 1 << 20),
                        (128, 1 << 20)),
            bf16_mla=((64, 32), (64, 128), (8, 128)), bf16_idx=((32, 131072), (128, 8192)),
            sweep_shapes=((64, 32), (8, 128)),
            sweep=((64, 64, 4, 2, None), (32, 64, 8, 3, None), (64, 32, 8, 2, None), (64, 64, 8, 3, None),
                   (64, 64, 8, 2, 1), (64, 64, 8, 2, 2), (64, 64, 8, 2, 8), (64, 64, 8, 2, 16), (128, 64, 8, 2, None),
                   (64, 16, 4, 2, None)),
            scores_only=((32, 131072), (128, 8192)), block_s=(128, 64, 256), s_chunks=(16384, 65536), idx_diag=(32, 131072),
            mid=(32, 64), prefill_T=2048, ref_idx=(32, 8192), max_tokens=1 << 25, interpret=False)
# --smoke: the same code paths at tiny sizes in interpret mode (checks the script itself on any backend).
SMOKE = dict(mla_rows=1 << 12, K=64, mla_decode=((16, (2,)),), idx_decode=((2, 512),), bf16_mla=((16, 2),),
             bf16_idx=((2, 256),), sweep_shapes=((16, 2),),
             sweep=((32, 16, 4, 2, None), (32, 16, 4, 2, 1)), scores_only=((2, 256),), block_s=(128,), s_chunks=(256,),
             idx_diag=(2, 512), mid=(2, 16), prefill_T=4, ref_idx=(2, 256), max_tokens=1 << 12, interpret=True)


def gpu_plan(bench, cfg, sz):
    A, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    K = sz["K"] or cfg.index_topk
    I, Dk = cfg.index_n_heads, cfg.index_head_dim
    ip = sz["interpret"]
    key = jax.random.PRNGKey(0)
    lay, arena = mla_arena(key, sz["mla_rows"], A, R, MLA_FP8)  # full: 1M rows, 656 MB, far beyond L2
    print(f"sparse MLA decode (Pallas, {MLA_FP8} rows, bf16 dots):")
    for N, Ts in sz["mla_decode"]:
        for T in Ts:
            sparse_mla_case(bench, key, lay, arena, T=T, N=N, K=K, A=A, R=R, impl="pallas_triton", precision="bf16",
                            interpret=ip)
    print(f"indexer decode (Pallas scores + sort merge, {KEY_FP8} keys):")
    for B, S in sz["idx_decode"]:
        indexer_case(bench, key, B=B, S=S, I=I, Dk=Dk, K=K, row_dtype=KEY_FP8, impl="pallas_triton",
                     max_tokens=sz["max_tokens"], precision="bf16", interpret=ip)
    print("second case: bf16 rows (sparse MLA 1152 B rows, indexer 256 B keys):")
    lay16, arena16 = mla_arena(key, sz["mla_rows"], A, R, "bfloat16")  # full: 1.2 GB
    for N, T in sz["bf16_mla"]:
        sparse_mla_case(bench, key, lay16, arena16, T=T, N=N, K=K, A=A, R=R, impl="pallas_triton", precision="bf16",
                        interpret=ip)
    del arena16
    for B, S in sz["bf16_idx"]:
        indexer_case(bench, key, B=B, S=S, I=I, Dk=Dk, K=K, row_dtype="bfloat16", impl="pallas_triton",
                     max_tokens=sz["max_tokens"], precision="bf16", interpret=ip)
    print("sparse MLA launch-parameter sweep:")
    for N, T in sz["sweep_shapes"]:
        for bk, bh, nw, ns, sp in sz["sweep"]:
            sparse_mla_case(bench, key, lay, arena, T=T, N=N, K=K, A=A, R=R, impl="pallas_triton", precision="bf16",
                            block_k=bk, block_h=bh, num_warps=nw, num_stages=ns, num_splits=sp, interpret=ip,
                            label=f"bk={bk} bh={bh} w={nw} st={ns} sp={sp}")
    print("indexer diagnostics:")
    for B, S in sz["scores_only"]:
        for bs in sz["block_s"]:
            indexer_scores_only(bench, key, B=B, S=S, I=I, Dk=Dk, row_dtype=KEY_FP8, block_s=bs, interpret=ip)
    B, S = sz["idx_diag"]
    indexer_case(bench, key, B=B, S=S, I=I, Dk=Dk, K=K, row_dtype=KEY_FP8, impl="pallas_triton",
                 max_tokens=sz["max_tokens"], precision="bf16", threshold_merge=False, interpret=ip,
                 label="full-sort merge")
    for sc in sz["s_chunks"]:
        indexer_case(bench, key, B=B, S=S, I=I, Dk=Dk, K=K, row_dtype=KEY_FP8, impl="pallas_triton",
                     max_tokens=sz["max_tokens"], precision="bf16", s_chunk=sc, interpret=ip, label=f"s_chunk={sc}")
    print("precision 'highest', prefill, references:")
    T, N = sz["mid"]
    sparse_mla_case(bench, key, lay, arena, T=T, N=N, K=K, A=A, R=R, impl="pallas_triton", precision="highest",
                    interpret=ip)
    sparse_mla_case(bench, key, lay, arena, T=sz["prefill_T"], N=N, K=K, A=A, R=R, impl="pallas_triton",
                    precision="bf16", interpret=ip, label="prefill")
    sparse_mla_case(bench, key, lay, arena, T=T, N=N, K=K, A=A, R=R, impl="xla")
    B, S = sz["ref_idx"]
    indexer_case(bench, key, B=B, S=S, I=I, Dk=Dk, K=K, row_dtype=KEY_FP8, impl="xla", max_tokens=sz["max_tokens"])


def cpu_plan(bench, cfg):
    A, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    I, Dk = cfg.index_n_heads, cfg.index_head_dim
    key = jax.random.PRNGKey(0)
    for mla_dtype, key_dtype in ((MLA_FP8, KEY_FP8), ("bfloat16", "bfloat16")):
        lay, arena = mla_arena(key, 1 << 14, A, R, mla_dtype)
        print(f"sparse MLA decode (reference, {mla_dtype} rows, small shapes):")
        for T in (1, 4):
            sparse_mla_case(bench, key, lay, arena, T=T, N=8, K=256, A=A, R=R, impl="xla")
        print(f"indexer decode (reference, {key_dtype} keys, small shapes):")
        for S in (1024, 4096):
            indexer_case(bench, key, B=1, S=S, I=I, Dk=Dk, K=256, row_dtype=key_dtype, impl="xla", max_tokens=1 << 16)


# ----------------------------------------------------------------------------- FP8 weight matmuls

FP8_BLOCK = (128, 128)  # GLM-5.3 / DeepSeek-V3 FP8 checkpoints
FP8_FULL = dict(dense=(("q_b_proj TP8", 2048, 2048), ("kv_a_proj", 6144, 576), ("o_proj TP8", 2048, 6144)),
                dense_M=(1, 8, 32, 128, 4096), reference_M=(1, 4096),
                grouped=(("experts gate_up EP8", 6144, 2048), ("experts down EP8", 2048, 6144)), experts=32,
                grouped_M=(64, 1024, 4096), sweep_M=(1, 128, 4096),
                sweep=((16, 32, None, 4, 3), (16, 128, None, 4, 3), (16, 64, 1, 4, 3), (64, 64, None, 4, 4),
                       (64, 128, 1, 8, 3), (128, 128, 1, 8, 3), (64, 256, 1, 8, 3)),
                check=(33, 2048, 576, 300, 8), interpret=False)
FP8_SMOKE = dict(dense=(("tiny", 256, 160),), dense_M=(1, 20), reference_M=(1,), grouped=(("tiny experts", 256, 128),),
                 experts=4, grouped_M=(24,), sweep_M=(1,), sweep=((16, 32, 2, 4, 3),), check=(5, 256, 160, 24, 4),
                 interpret=True)


def fp8_weights(key, shape):
    """Random fp8 weights of `shape` (`[K, N]` or `[E, K, N]`), quantised on the device; also their
    bf16 dequantised copy for the bf16 baseline."""
    from kernels.fp8_matmul import dequantize_fp8_blocks, quantize_fp8_blocks
    w = jax.random.normal(key, shape, jnp.float32) * 0.02
    w_fp8, scale = quantize_fp8_blocks(w, FP8_BLOCK)
    del w
    return w_fp8, scale, dequantize_fp8_blocks(w_fp8, scale, FP8_BLOCK, jnp.bfloat16)


def fp8_dense_cases(bench, key, label, K, N, Ms, sz, reference_Ms=()):
    from kernels.fp8_matmul.pallas_triton import fp8_matmul_pallas_triton
    from kernels.fp8_matmul.reference import fp8_matmul_reference
    k1, k2 = jax.random.split(key)
    w_fp8, scale, w16 = fp8_weights(k1, (K, N))
    fp8_bytes = K * N + 4 * scale.size
    for M in Ms:
        x = jax.random.normal(k2, (M, K), jnp.float32).astype(jnp.bfloat16)
        io = 2 * M * K + 2 * M * N
        flops = 2 * M * K * N
        meta = dict(op="fp8_matmul", shape=label, M=M, K=K, N=N)
        rec = bench.run(f"fp8 pallas {label} M={M} [{K},{N}]",
                        jax.jit(lambda x, w, s: fp8_matmul_pallas_triton(x, w, s, block=FP8_BLOCK,
                                                                         interpret=sz["interpret"])),
                        (x, w_fp8, scale), fp8_bytes + io, flops, impl="pallas_triton", **meta)
        if rec and "seconds" in rec:
            rec["fp8_roofline_fraction"] = max((fp8_bytes + io) / bench.hbm, flops / H200_FP8_FLOPS) / rec["seconds"]
        bench.run(f"bf16 xla dot {label} M={M} [{K},{N}]", jax.jit(lambda x, w: jnp.dot(x, w)), (x, w16),
                  2 * K * N + io, flops, impl="xla_bf16", **meta)
        if M in reference_Ms:
            bench.run(f"fp8 xla reference {label} M={M} [{K},{N}]",
                      jax.jit(lambda x, w, s: fp8_matmul_reference(x, w, s, block=FP8_BLOCK)), (x, w_fp8, scale),
                      fp8_bytes + io, flops, impl="xla_fp8", **meta)
    bench.save()


def fp8_group_sizes(key, M, E):
    """Routed rows spread at random over E experts (multinomial), int32 [E]."""
    e = jax.random.randint(key, (M,), 0, E)
    return jnp.bincount(e, length=E).astype(jnp.int32)


def fp8_grouped_cases(bench, key, label, K, N, E, Ms, sz):
    from kernels.fp8_matmul.pallas_triton import fp8_grouped_matmul_pallas_triton
    k1, k2, k3 = jax.random.split(key, 3)
    w_fp8, scale, w16 = fp8_weights(k1, (E, K, N))
    for M in Ms:
        x = jax.random.normal(k2, (M, K), jnp.float32).astype(jnp.bfloat16)
        gs = fp8_group_sizes(k3, M, E)
        used = int(jnp.sum(gs > 0))
        io = 2 * M * K + 4 * M * N
        flops = 2 * M * K * N
        fp8_bytes = used * (K * N + 4 * scale[0].size) + io
        meta = dict(op="fp8_grouped_matmul", shape=label, M=M, K=K, N=N, E=E, experts_used=used)
        rec = bench.run(f"fp8 pallas grouped {label} M={M} E={E} [{K},{N}]",
                        jax.jit(lambda x, w, s, g: fp8_grouped_matmul_pallas_triton(
                            x, w, s, g, block=FP8_BLOCK, interpret=sz["interpret"])),
                        (x, w_fp8, scale, gs), fp8_bytes, flops, impl="pallas_triton", **meta)
        if rec and "seconds" in rec:
            rec["fp8_roofline_fraction"] = max(fp8_bytes / bench.hbm, flops / H200_FP8_FLOPS) / rec["seconds"]
        bench.run(f"bf16 xla ragged_dot {label} M={M} E={E} [{K},{N}]",
                  jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32)),
                  (x, w16, gs), used * 2 * K * N + io, flops, impl="xla_bf16", **meta)
    bench.save()


def fp8_sweep(bench, key, label, K, N, sz):
    """Launch-parameter sweep of the dense kernel: (block_m, block_n, split_k, num_warps, num_stages)."""
    from kernels.fp8_matmul.pallas_triton import fp8_matmul_pallas_triton
    k1, k2 = jax.random.split(key)
    w_fp8, scale, _ = fp8_weights(k1, (K, N))
    for M in sz["sweep_M"]:
        x = jax.random.normal(k2, (M, K), jnp.float32).astype(jnp.bfloat16)
        for bm, bn, sk, nw, ns in sz["sweep"]:
            f = jax.jit(lambda x, w, s, bm=bm, bn=bn, sk=sk, nw=nw, ns=ns: fp8_matmul_pallas_triton(
                x, w, s, block=FP8_BLOCK, block_m=bm, block_n=bn, split_k=sk, num_warps=nw, num_stages=ns,
                interpret=sz["interpret"]))
            bench.run(f"fp8 pallas {label} M={M} bm={bm} bn={bn} sk={sk} w={nw} st={ns}", f, (x, w_fp8, scale),
                      K * N + 4 * scale.size + 2 * M * K + 2 * M * N, 2 * M * K * N, op="fp8_matmul_sweep",
                      impl="pallas_triton", shape=label, M=M, K=K, N=N,
                      config=dict(block_m=bm, block_n=bn, split_k=sk, num_warps=nw, num_stages=ns))


def fp8_check_on_device(sz) -> dict:
    """Pallas vs reference on this device: max |difference| / max |reference| for bf16 and fp32 x
    (dense, partial N block) and the grouped form with an empty group."""
    from kernels.fp8_matmul.pallas_triton import fp8_grouped_matmul_pallas_triton, fp8_matmul_pallas_triton
    from kernels.fp8_matmul.reference import fp8_grouped_matmul_reference, fp8_matmul_reference
    M, K, N, Mg, E = sz["check"]
    ip = sz["interpret"]
    key = jax.random.PRNGKey(5)
    out = {}
    w_fp8, scale, _ = fp8_weights(key, (K, N))
    for dt in (jnp.bfloat16, jnp.float32):
        x = jax.random.normal(key, (M, K), jnp.float32).astype(dt)
        try:
            ref = fp8_matmul_reference(x, w_fp8, scale, block=FP8_BLOCK, out_dtype=jnp.float32)
            got = fp8_matmul_pallas_triton(x, w_fp8, scale, block=FP8_BLOCK, out_dtype=jnp.float32, interpret=ip)
            out[f"fp8_matmul x={jnp.dtype(dt).name}"] = {
                "rel_err": float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))}
        except Exception as e:  # noqa: BLE001
            out[f"fp8_matmul x={jnp.dtype(dt).name}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    wg, sg, _ = fp8_weights(key, (E, K, N))
    x = jax.random.normal(key, (Mg, K), jnp.float32).astype(jnp.bfloat16)
    gs = fp8_group_sizes(key, Mg - 3, E).at[1].set(0)  # an empty group; 3+ rows past the sum
    try:
        ref = fp8_grouped_matmul_reference(x, wg, sg, gs, block=FP8_BLOCK)
        got = fp8_grouped_matmul_pallas_triton(x, wg, sg, gs, block=FP8_BLOCK, interpret=ip)
        out["fp8_grouped_matmul x=bfloat16"] = {"rel_err": float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))),
                                                "tail_rows_zero": bool(jnp.all(got[int(jnp.sum(gs)):] == 0))}
    except Exception as e:  # noqa: BLE001
        out["fp8_grouped_matmul x=bfloat16"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for k, v in out.items():
        print(f"  check {k:32s} {v}")
    return out


def fp8_plan(bench, sz) -> dict:
    """The FP8 section (GPU, or --smoke): device checks, then the cases in priority order."""
    print(f"FP8 weight matmuls (block {FP8_BLOCK}; W8A16 Pallas vs bf16 XLA dot):")
    checks = fp8_check_on_device(sz)
    key = jax.random.PRNGKey(7)
    for label, K, N in sz["dense"]:
        fp8_dense_cases(bench, key, label, K, N, sz["dense_M"], sz, sz["reference_M"])
    for label, K, N in sz["grouped"]:
        fp8_grouped_cases(bench, key, label, K, N, sz["experts"], sz["grouped_M"], sz)
    label, K, N = sz["dense"][-1]
    print(f"FP8 launch-parameter sweep ({label}):")
    fp8_sweep(bench, key, label, K, N, sz)
    return checks


def fp8_summary(bench):
    """Per (shape, M): the fp8 Pallas time against the bf16 dot's."""
    by = {}
    for r in bench.records:
        if "seconds" in r and r.get("op") in ("fp8_matmul", "fp8_grouped_matmul"):
            by.setdefault((r["op"], r["shape"], r["M"]), {})[r["impl"]] = r
    if not by:
        return
    print("FP8 summary: shape, M → fp8 Pallas vs bf16 XLA (ms, % of HBM bandwidth, % of roofline)")
    for (op, shape, M), d in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        p, b = d.get("pallas_triton"), d.get("xla_bf16")
        line = f"  {shape:22s} M={M:5d}:"
        if p:
            line += (f" fp8 {p['seconds'] * 1e3:8.3f} ms {100 * p['hbm_fraction']:5.1f}% BW "
                     f"{100 * p['roofline_fraction']:5.1f}% roof")
        if b:
            line += f" | bf16 {b['seconds'] * 1e3:8.3f} ms {100 * b['hbm_fraction']:5.1f}% BW"
        if p and b:
            line += f" | speed-up {b['seconds'] / p['seconds']:.2f}x"
        print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for bench_kernels.json")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="stop starting new cases after this many seconds (device checks included)")
    ap.add_argument("--smoke", action="store_true",
                    help="run the GPU plan's code paths at tiny sizes in Pallas interpret mode (any backend)")
    ap.add_argument("--sections", default="attention,fp8",
                    help="comma-separated sections to run, in this order: attention (sparse MLA and the indexer), "
                         "fp8 (the FP8 weight matmuls; GPU or --smoke only)")
    args = ap.parse_args()
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if not set(sections) <= {"attention", "fp8"}:
        ap.error(f"unknown section(s) in {args.sections!r}: choose from attention, fp8")
    os.makedirs(args.out, exist_ok=True)
    cfg = preset("glm-5.3")
    backend = jax.default_backend()
    dev = jax.devices()[0]
    print(f"backend {backend}, device {getattr(dev, 'device_kind', dev)}; GLM-5.3 A={cfg.kv_lora_rank} "
          f"R={cfg.qk_rope_head_dim} K={cfg.index_topk} indexer {cfg.index_n_heads}x{cfg.index_head_dim}")
    roof = roofline_summary(cfg)
    print_roofline(roof)
    t0 = time.perf_counter()
    bw = copy_bandwidth((1 << 30) if backend == "gpu" and not args.smoke else (1 << 26))
    print(f"measured copy bandwidth {bw / 1e9:.1f} GB/s (read + write), {time.perf_counter() - t0:.1f}s")
    result = {"backend": backend, "smoke": args.smoke, "device": str(getattr(dev, "device_kind", dev)), "roofline": roof,
              "measured_copy_bytes_s": bw, "jax": jax.__version__, "sections": sections,
              "fp8_peaks": {"fp8_flops": H200_FP8_FLOPS, "bf16_flops": H200_BF16_FLOPS, "hbm_bytes_s": H200_HBM_BYTES_S}}
    path = os.path.join(args.out, "bench_kernels.json")
    if backend == "gpu" or args.smoke:
        bench = Bench(args.budget_s, H200_HBM_BYTES_S, H200_BF16_FLOPS, path, result)
        if "attention" in sections:
            print("device checks (Pallas vs reference):")
            result["checks"] = check_on_device(cfg, small=args.smoke)
            gpu_plan(bench, cfg, SMOKE if args.smoke else FULL)
        if "fp8" in sections:
            result["fp8_checks"] = fp8_plan(bench, FP8_SMOKE if args.smoke else FP8_FULL)
    else:
        # Fractions against this machine's measured copy rate (no FLOP peak known: use the H200's).
        bench = Bench(args.budget_s, bw, H200_BF16_FLOPS, path, result)
        if "attention" in sections:
            cpu_plan(bench, cfg)
            print("(CPU run: the H200 targets — sparse-MLA decode >= 70% of HBM bandwidth at batch >= 32, indexer "
                  "decode >= 60% — can only be measured on the GPU.)")
        if "fp8" in sections:
            msg = (f"skipped: no GPU (backend {backend}); the FP8 weight-matmul section times the Pallas kernels "
                   "against the H200 roofline and needs one (--smoke runs its code paths in interpret mode)")
            print(f"FP8 weight matmuls: {msg}")
            result["fp8"] = {"skipped": msg}
    bench.save()
    if bench.skipped:
        print(f"skipped (budget): {len(bench.skipped)}: " + "; ".join(bench.skipped))
    best = {}
    for r in bench.records:
        if "seconds" in r and r["op"] in ("sparse_mla", "indexer_topk"):
            k = (r["op"], r["row_dtype"], r.get("N"), r.get("T") or r.get("B"), r.get("S"))
            if k not in best or r["hbm_fraction"] > best[k]["hbm_fraction"]:
                best[k] = r
    print("summary (best per shape): op, row dtype, heads, batch, context → % of HBM bandwidth")
    for (op, row_dtype, N, T, S), r in sorted(best.items(), key=lambda kv: str(kv[0])):
        target = ""
        if backend == "gpu" and not args.smoke and r["impl"] == "pallas_triton":
            if op == "sparse_mla" and T >= 32 and T < 1024:
                target = f"  target 70%: {'met' if r['hbm_fraction'] >= 0.7 else 'MISSED'}"
            elif op == "indexer_topk":
                target = f"  target 60%: {'met' if r['hbm_fraction'] >= 0.6 else 'MISSED'}"
        print(f"  {op:13s} {row_dtype:22s} N={N} T/B={T} S={S}: {100 * r['hbm_fraction']:.1f}%  ({r['name']}){target}")
    fp8_summary(bench)
    print(f"wrote {path}; total {time.perf_counter() - bench.t_start:.0f}s of cases")


if __name__ == "__main__":
    main()
