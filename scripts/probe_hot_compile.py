"""How long XLA:CPU takes to compile a HiSparse engine's plain and hot step programs (for the suite's
time and a CPU server's start-up), optionally against another revision's code, alternated.

    PYTHONPATH=. .venv/bin/python scripts/probe_hot_compile.py --out DIR [--baseline-rev REV] [--repeats 3]

Each run is a fresh process with the compilation cache off, configured as the suite's HiSparse
engine tests (the 14-layer tiny checkpoint, a 36-page pool, `host_pool_gib` 0.05, a 1,024-row
prefill lease, one 64-token step bucket, programs compiled on first use): three 900-token prompts
for 16 greedy tokens, which run plain steps first and hot steps once the pool is short. Records
jit's backend compile seconds of the plain program (the first step program compiled) and of the
hot one (the second), and the run's steps. With `--baseline-rev`, a `git worktree` of that revision
runs the same worker, alternating with this tree's, `--repeats` times each. Prints a table and
writes `DIR/hot_compile.json`. Wall seconds: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys
os.environ["GLM53_COMPILATION_CACHE"] = "off"
sys.path.insert(0, os.getcwd())
from jax import monitoring
compiles = []
monitoring.register_event_duration_secs_listener(
    lambda ev, d, **kw: compiles.append(d) if ev == "/jax/core/compile/backend_compile_duration" else None)
import numpy as np
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.types import SamplingParams
e = build_engine(EngineArgs(max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=64, cuda_graph_sizes=[],
                            num_gpu_blocks_override=36, compile_progress=False, disable_log_stats=True,
                            precompile_token_paddings=[], skip_precompile=True,
                            attention_config={"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 1024}}))
rng = np.random.default_rng(0)
for i in range(3):
    e.add_request(f"r{i}", rng.integers(10, 400, 900).tolist(), SamplingParams(temperature=0, max_tokens=16))
steps = 0
while e.has_unfinished_requests():
    e.step()
    steps += 1
big = [d for d in compiles if d > 0.3]  # the step programs (small eager programs compile in ms)
print(json.dumps({"plain_s": round(big[0], 2), "hot_s": round(big[1], 2) if len(big) > 1 else None,
                  "steps": steps, "hot_steps": e.runner.num_hot_steps}))
"""


def run_worker(cwd: str) -> dict:
    env = {**os.environ, "PYTHONPATH": cwd}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=2").strip()  # as the suite
    p = subprocess.run([sys.executable, "-c", WORKER], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for hot_compile.json")
    ap.add_argument("--baseline-rev", help="also run this git revision's code (a temporary worktree), alternated")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each tree (default 3)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    trees = {"current": REPO}
    tmp = None
    if a.baseline_rev:
        tmp = tempfile.mkdtemp(prefix="hot_compile_")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tmp, a.baseline_rev], check=True,
                       capture_output=True)
        trees = {a.baseline_rev: tmp, "current": REPO}
    rows = []
    try:
        for i in range(a.repeats):
            for name, cwd in trees.items():
                r = {"tree": name, "repeat": i, **run_worker(cwd)}
                rows.append(r)
                print(f"{name:<12} run {i}: plain {r['plain_s']:.2f} s, hot {r['hot_s']} s "
                      f"({r['steps']} steps, {r['hot_steps']} hot)", flush=True)
    finally:
        if tmp:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tmp], check=False, capture_output=True)
    summary = {}
    for name in trees:
        mine = [r for r in rows if r["tree"] == name]
        summary[name] = {k: round(statistics.mean(r[k] for r in mine if r[k] is not None), 2)
                         for k in ("plain_s", "hot_s")}
        print(f"{name:<12} mean of {len(mine)}: plain {summary[name]['plain_s']:.2f} s, hot {summary[name]['hot_s']:.2f} s")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "hot_compile.json"), "w") as f:
        json.dump({"runs": rows, "mean": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
