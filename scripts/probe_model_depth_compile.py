"""How an engine's step compile and run time depend on the test model's depth (for the suite's time).

    PYTHONPATH=. .venv/bin/python scripts/probe_model_depth_compile.py --out DIR

Builds the tiny checkpoint's structure at three depths — `tiny` (14 layers: 3 dense, IndexShare
groups {0} {1} {2..5} and two stacked groups of 4), a 7-layer twin (2 dense; groups {0} {1, 2} and
two stacked groups of 2) and a 2-layer model — each in a fresh process with the compilation cache
off, as the test engines are configured (max_model_len 512, 4 sequences, a 128-token budget, one
step bucket, programs compiled on first use), runs three 200-token prompts for 32 greedy tokens,
and records jit's backend compile seconds and the run's wall seconds. Prints a table and writes
`DIR/model_depth_compile.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "tiny": {},
    "7 layers": {"num_hidden_layers": 7, "first_k_dense_replace": 2,
                 "indexer_types": ["full", "full", "shared", "full", "shared", "full", "shared"]},
    "2 layers": {"num_hidden_layers": 2, "first_k_dense_replace": 1, "indexer_types": ["full", "full"]},
}


def worker(name: str) -> dict:
    os.environ["GLM53_COMPILATION_CACHE"] = "off"
    from jax import monitoring

    compiles: list[float] = []
    monitoring.register_event_duration_secs_listener(
        lambda ev, d, **kw: compiles.append(d) if ev == "/jax/core/compile/backend_compile_duration" else None)
    import numpy as np

    import glm53.tiny_checkpoint as tc
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.types import SamplingParams

    tc.TINY_HF_CONFIG.update(VARIANTS[name])  # this process only
    path = tempfile.mkdtemp()
    tc.write_tiny_checkpoint(path)
    e = build_engine(EngineArgs(model=path, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
                                cuda_graph_sizes=[], precompile_token_paddings=[], compile_progress=False,
                                disable_log_stats=True, skip_precompile=True))
    rng = np.random.default_rng(0)
    for i in range(3):
        e.add_request(f"r{i}", rng.integers(10, 400, 200).tolist(), SamplingParams(temperature=0, max_tokens=32))
    t0, steps = time.perf_counter(), 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
    return {"variant": name, "layers": e.config.num_hidden_layers, "steps": steps,
            "run_s": round(time.perf_counter() - t0, 2), "compile_s": round(sum(compiles), 2),
            "step_compile_s": round(max(compiles), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for model_depth_compile.json")
    ap.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    rows = []
    for name in VARIANTS:
        p = subprocess.run([sys.executable, __file__, "--out", args.out, "--worker", name], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{name:<10} {r['layers']:>2} layers: step compile {r['step_compile_s']:.2f} s, "
              f"{r['steps']} steps run in {r['run_s']:.2f} s (compile included)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "model_depth_compile.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
