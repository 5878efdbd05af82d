"""The HiSparse hot-buffer resolver's pure-JAX path (`kernels.hot_resolve.reference`, the CPU
path of every HiSparse step) timed at the shapes the engine runs it, against the implementation of
an earlier revision, side by side in one process, with the two outputs compared for equality.

    PYTHONPATH=. .venv/bin/python scripts/bench_hot_resolve.py --baseline-rev HEAD~1 --out DIR

Cases (one request of each batch holds hot state unless said; the runner pads batch rows to
`max_num_seqs + 1`):

* `long_prefill_M640`, `long_prefill_M1856`: a 64-token prefill chunk of one request (T = 64,
  top-k 64, 5 batch rows) over a 9,408-token context whose pages are all off the device, with a
  prefill lease of 640 / 1,856 rows — `scripts/bench_long_prefill.py`'s lease sweep.
* `decode_B16_M128`: 16 decoding requests (T = 16, 17 batch rows), each over a 2,048-token
  context off the device, a decode lease of 128 rows (2 × top-k).

Each case runs a steady state: the state comes from resolving earlier random selections (so
the lease is full and holds hits), then `--calls` timed calls each with fresh random selections
(the state threaded through). Both implementations get the same inputs; their slots, miss
lists, stats and new state must be equal (integers: exactly), else the script says so and exits 1.
Writes DIR/hot_resolve.json and prints a table (ms per call, medians of `--repeats` rounds).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax
import jax.numpy as jnp

TPP, K = 64, 64
CASES = {
    # name: (T, batch rows, requests with state, context tokens, lease rows)
    "long_prefill_M640": (64, 5, 1, 9408, 640),
    "long_prefill_M1856": (64, 5, 1, 9408, 1856),
    "decode_B16_M128": (16, 17, 16, 2048, 128),
}


def load_revision(rev: str):
    """`hot_resolve_reference` of `kernels/hot_resolve/reference.py` at git revision `rev`."""
    src = subprocess.run(["git", "show", f"{rev}:kernels/hot_resolve/reference.py"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "hot_resolve_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("hot_resolve_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.hot_resolve_reference


def case_inputs(T, B, R, ctx, M, rng):
    """Static tables of a case and a generator of fresh selections."""
    P = ctx // TPP
    tokens_per_req = T // R
    req_idx = np.repeat(np.arange(R), tokens_per_req).astype(np.int32)
    bt = np.zeros((B, P), np.int32)  # nothing resident
    ht = np.zeros((B, P), np.int32)
    for b in range(R):
        ht[b] = 1 + b * P + np.arange(P)  # host blocks (block 0 is the null block)
    H = M // TPP
    hot = np.zeros((B, H), np.int32)
    for b in range(R):
        hot[b] = 1000 + b * H + np.arange(H)
    state_row = np.full(B, -1, np.int32)
    state_row[:R] = np.arange(R)
    reset = np.full(B, M, np.int32)
    num_host_blocks = 1 + R * P

    def selections():
        return jnp.asarray(rng.integers(0, ctx, (T, K)), jnp.int32)

    static = (jnp.asarray(req_idx), jnp.asarray(bt), jnp.asarray(ht), jnp.asarray(hot), jnp.asarray(state_row),
              jnp.asarray(reset))
    return static, selections, num_host_blocks


def run_case(name, impls, calls, repeats, seed):
    T, B, R, ctx, M = CASES[name]
    S = R + 1
    rng = np.random.default_rng(seed)
    static, selections, nhb = case_inputs(T, B, R, ctx, M, rng)
    fns = {k: jax.jit(lambda *a, f=f: f(*a, tokens_per_page=TPP)) for k, f in impls.items()}
    # Warm state: resolve until the leases are full (every implementation from the same state).
    row0 = jnp.full((S, M), -1, jnp.int32)
    rank0 = jnp.tile(jnp.arange(M, dtype=jnp.int32), (S, 1))
    first = next(iter(fns.values()))
    for _ in range(4):
        out = first(selections(), *static, row0, rank0, nhb)
        row0, rank0 = out[4], out[5]
    inputs = [selections() for _ in range(calls)]
    result = {"T": T, "batch_rows": B, "requests": R, "context_tokens": ctx, "lease_rows": M, "top_k": K}
    outs = {}
    for k, f in fns.items():  # compile, and the outputs compared below
        row, rank, got = row0, rank0, []
        for sel in inputs:
            o = jax.block_until_ready(f(sel, *static, row, rank, nhb))
            row, rank = o[4], o[5]
            got.append([np.asarray(x) for x in o])
        outs[k] = got
    names = list(fns)
    equal = all(all(np.array_equal(a, b) for a, b in zip(x, y)) for x, y in zip(outs[names[0]], outs[names[-1]]))
    result["outputs_equal"] = equal
    result["misses_per_call"] = float(np.mean([o[3][1] for o in outs[names[0]]]))
    result["hits_per_call"] = float(np.mean([o[3][0] for o in outs[names[0]]]))
    times = {k: [] for k in fns}
    for _ in range(repeats):  # rounds alternate the implementations
        for k, f in fns.items():
            row, rank = row0, rank0
            t = time.perf_counter()
            for sel in inputs:
                o = f(sel, *static, row, rank, nhb)
                row, rank = o[4], o[5]
            jax.block_until_ready(o)
            times[k].append((time.perf_counter() - t) / calls * 1e3)
    result["ms_per_call"] = {k: round(float(np.median(v)), 3) for k, v in times.items()}
    if len(names) == 2:
        result["speedup"] = round(result["ms_per_call"][names[0]] / result["ms_per_call"][names[1]], 2)
    return result


def main(argv=None) -> int:
    from kernels.hot_resolve.reference import hot_resolve_reference

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline-rev", help="also time the implementation at this git revision (and compare outputs)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    impls = {}
    if args.baseline_rev:
        try:
            impls[f"baseline ({args.baseline_rev})"] = load_revision(args.baseline_rev)
        except subprocess.CalledProcessError as e:
            ap.error(f"--baseline-rev {args.baseline_rev!r}: git could not show the resolver there "
                     f"({(e.stderr or '').strip()})")
    impls["current"] = hot_resolve_reference
    results = {}
    for name in args.cases.split(","):
        results[name] = run_case(name, impls, args.calls, args.repeats, args.seed)
        r = results[name]
        print(f"{name}: " + ", ".join(f"{k} {v} ms" for k, v in r["ms_per_call"].items())
              + (f", {r['speedup']}x" if "speedup" in r else "")
              + f"; {r['misses_per_call']:.0f} misses, {r['hits_per_call']:.0f} hits a call"
              + ("" if r["outputs_equal"] else "; OUTPUTS DIFFER"), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=False).stdout.strip()
    (args.out / "hot_resolve.json").write_text(json.dumps(
        {"argv": sys.argv[1:] if argv is None else argv, "head": head, "backend": jax.default_backend(),
         "cases": results}, indent=1) + "\n")
    return 0 if all(r["outputs_equal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
