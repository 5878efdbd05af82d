"""Engine check of the capacity planner for Hybrid HiSparse on parallel layouts (engine units).

The scaled analog of `scripts/capacity.py`'s "HiSparse across layouts" table on the CPU (8
simulated devices, the shipped tiny checkpoint): the same small device pool (pages per arena
shard) and an ample host pool on one device, under TP2, TP2 × DCP2 and DP2 + EP, and on one device
with MTP speculation (k = 2: the MTP layer's rows move with their pages), with --max-model-len L (default
32 × index_topk). Each layout gets 2 × (the planner's count) requests of L − 128 prompt tokens and
128 output tokens (a request decodes longer than the next one prefills, so the running set is
bounded by memory, not by the token budget), submitted at once; the script records the running requests after every step and
compares their maximum with the planner's prediction for the engine's pool
(`serving.hisparse.HiSparse.plan`: `glm53.capacity.predict_hisparse_requests` with the engine's
reserve, per replica × replicas, capped by --max-num-seqs), next to the device-resident count
(`glm53.capacity.engine_capacity_summary`'s rule). Prints a table and writes
`DIR/capacity_engine_check.json`.

    python scripts/capacity_engine_check.py --out /tmp/cap      # ≈ 10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from glm53.capacity import predict_device_resident_requests  # noqa: E402
from serving.engine import EngineArgs  # noqa: E402
from serving.engine_factory import build_engine  # noqa: E402
from serving.types import SamplingParams  # noqa: E402
from sharding.mesh import ParallelConfig  # noqa: E402

LAYOUTS = {
    "1 device": None,
    "TP2": ParallelConfig(tensor_parallel_size=2),
    "TP2 x DCP2": ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
    "DP2 + EP": ParallelConfig(data_parallel_size=2, enable_expert_parallel=True),
    # MTP speculation: the MTP layer's latent rows go to the host pool with their pages (one more
    # layer of the `mla` group), its keys stay on the device; the decode lease is (k + 2) × top-k.
    "1 device + MTP k=2": None,
}
SPECULATIVE_TOKENS = {"1 device + MTP k=2": 2}
OUTPUT_TOKENS = 128  # decodes outlast a prefill (8 steps at 256 tokens), so admissions accumulate


def measure(name: str, par, args) -> dict:
    eargs = EngineArgs(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, cuda_graph_sizes=[],
                       num_gpu_blocks_override=args.num_blocks, kv_cache_dtype="bfloat16", compile_progress=False,
                       disable_log_stats=True, parallel=par,
                       attention_config={"hisparse_config": {"host_pool_gib": args.host_pool_gib}},
                       speculative_config=({"method": "mtp", "num_speculative_tokens": SPECULATIVE_TOKENS[name]}
                                           if name in SPECULATIVE_TOKENS else None))
    engine = build_engine(eargs)
    hs = engine.hisparse
    dp = par.data_parallel_size if par is not None else 1
    plan = hs.plan(args.num_blocks, args.max_model_len, args.max_num_batched_tokens)
    predicted = min(plan.requests, args.max_num_seqs) * dp
    resident = predict_device_resident_requests(hs.policy.kv, args.num_blocks, args.max_model_len) * dp
    n = max(2 * predicted, 2)
    rng = np.random.default_rng(0)
    for i in range(n):
        engine.add_request(f"r{i}", rng.integers(10, 480, args.max_model_len - OUTPUT_TOKENS).tolist(),
                           SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    running, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running.append(int(engine.gauges.num_requests_running()))
        assert engine.audit() == []
    wall = time.perf_counter() - t0
    scheds = [r.scheduler for r in engine.replicas] if hasattr(engine, "replicas") else [engine.scheduler]
    row = dict(layout=name, requests=n, predicted_running=predicted, measured_max_running=max(running),
               device_resident=resident, plan_per_replica=dict(first_pages=plan.first_pages,
                                                              steady_pages=plan.steady_pages,
                                                              hot_pages=plan.hot_pages,
                                                              device_bound=plan.device_bound,
                                                              host_bound=plan.host_bound),
               preemptions=sum(s.num_preemptions_total for s in scheds), steps=len(running), wall_s=round(wall, 1),
               hot_misses=hs.device.misses, within_1=abs(max(running) - predicted) <= 1)
    print(f"{name:<12} predicted {predicted:>3}  measured max running {max(running):>3}  device-resident "
          f"{resident:>3}  preemptions {row['preemptions']}  ({len(running)} steps, {wall:.0f} s)", flush=True)
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=64, help="arena pages per shard (incl. the null page)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--host-pool-gib", type=float, default=0.25, help="per replica (ample: the device bounds)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args(argv)
    rows = [measure(name, LAYOUTS[name], args) for name in args.layouts.split(",")]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "capacity_engine_check.json")
    with open(path, "w") as f:
        json.dump(dict(settings=vars(args), rows=rows), f, indent=1)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
