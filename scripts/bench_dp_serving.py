"""Served throughput of data-parallel layouts vs one device, on simulated devices, in one run.

    PYTHONPATH=. python scripts/bench_dp_serving.py [--out DIR (runs/bench_dp_serving)] [--requests 32]
        [--prompt-len 48] [--max-tokens 16] [--layouts single,dp2_ep2,dp8_ep8,dp4_tp2_ep8,dp2_pcp2_tp2_dcp4_ep8]

The shipped tiny checkpoint (fp32) served by `LLMEngine.from_args` (one device) and by
`serving.dp_engine.DataParallelEngine` (`--data-parallel-size N --enable-expert-parallel`, TP
inside the replicas for `dp4_tp2_ep8`; PCP2 × TP2 with DCP4 over both inside each replica for
`dp2_pcp2_tp2_dcp4_ep8`, engine pages of 256 tokens), greedy with `ignore_eos`: `--requests` prompts of
`--prompt-len` random tokens (fixed seed), all queued at once, `--max-tokens` new tokens each,
`max_num_seqs` = requests per replica. Per layout: wall time of the whole run after compiling
(compile excluded), engine steps, generated tokens/s, mean step wall time, mean device time per
step (`ModelRunner.last.device_s`) and mean host time per step (`LLMEngine.host_overhead_s`:
scheduling every replica, building and stacking the replicas' inputs, applying outputs). Also
checks that every layout's streams equal the single-device ones (`streams_equal`).

What the numbers mean: the 8 simulated XLA CPU devices share this machine's cores, so DP cannot
be faster here by parallelism; the run shows the host cost per replica and that DP steps are fewer
(each step carries every replica's requests). Writes `bench_dp_serving.json` to `--out`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from serving.engine import EngineArgs  # noqa: E402
from serving.engine_factory import build_engine  # noqa: E402
from serving.types import SamplingParams  # noqa: E402
from sharding.mesh import ParallelConfig  # noqa: E402

LAYOUTS = {
    "single": None,
    "dp2_ep2": ParallelConfig(data_parallel_size=2, enable_expert_parallel=True),
    "dp8_ep8": ParallelConfig(data_parallel_size=8, enable_expert_parallel=True),
    "dp4_tp2_ep8": ParallelConfig(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True),
    "dp2_pcp2_tp2_dcp4_ep8": ParallelConfig(data_parallel_size=2, prefill_context_parallel_size=2,
                                           tensor_parallel_size=2, decode_context_parallel_size=4,
                                           enable_expert_parallel=True),
}


def run_layout(name: str, prompts: list[list[int]], max_tokens: int) -> dict:
    par = LAYOUTS[name]
    dp = par.data_parallel_size if par is not None else 1
    per_replica = -(-len(prompts) // dp)
    engine = build_engine(EngineArgs(
        dtype="float32", max_model_len=len(prompts[0]) + max_tokens + 1, max_num_seqs=per_replica,
        max_num_batched_tokens=max(64, per_replica), num_gpu_blocks_override=4 * per_replica + 2,  # per shard
        compile_progress=False, disable_log_stats=True, parallel=par))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    streams: dict[str, list[int]] = {}
    device_s, host0, steps0 = 0.0, engine.host_overhead_s, engine.num_steps
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
        device_s += engine.runner.last.device_s
    wall = time.perf_counter() - t0
    steps = engine.num_steps - steps0
    if engine.audit():
        raise RuntimeError(f"{name}: audit failed: {engine.audit()}")
    tokens = sum(len(s) for s in streams.values())
    return dict(layout=name, replicas=dp, steps=steps, wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall,
                step_ms=1e3 * wall / steps, device_ms_per_step=1e3 * device_s / steps,
                host_ms_per_step=1e3 * (engine.host_overhead_s - host0) / steps, streams=streams)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench_dp_serving")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 450, a.prompt_len).tolist() for _ in range(a.requests)]
    rows = [run_layout(n, prompts, a.max_tokens) for n in a.layouts.split(",")]
    ref = rows[0]["streams"]
    print(f"{'layout':<24}{'steps':>6}{'tok/s':>9}{'step ms':>9}{'device ms':>11}{'host ms':>9}"
          f"  streams = {rows[0]['layout']}")
    for r in rows:
        r["streams_equal"] = r.pop("streams") == ref
        print(f"{r['layout']:<24}{r['steps']:>6}{r['tokens_per_s']:>9.1f}{r['step_ms']:>9.2f}"
              f"{r['device_ms_per_step']:>11.2f}{r['host_ms_per_step']:>9.2f}  {r['streams_equal']}")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "bench_dp_serving.json")
    with open(path, "w") as f:
        json.dump(dict(requests=a.requests, prompt_len=a.prompt_len, max_tokens=a.max_tokens, rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
