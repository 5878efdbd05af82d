"""How a step's time grows with the engine's static limits under DCP over PCP.

    PYTHONPATH=. .venv/bin/python scripts/probe_pcp_gather_cost.py --out DIR [--prefill]

Under DCP over PCP (the reference prefill engine's layout) each rank holds a share of every
request's rows, and sparse MLA brings other ranks' rows to its queries. It once read a copy of
every page of the step's block table per layer, (max_num_seqs + 1) x ceil(max_model_len /
(tokens_per_page x dcp)) pages whatever the requests held; now it exchanges the selected rows or
copies only the step's requests' pages, whichever moves fewer rows
(`glm53.attention.reads_selected_rows`); docs/results/pcp_gather_cost/ has the runs. This probe
serves two 100-token greedy requests (40 output tokens) on the tiny checkpoint under DP2 + EP,
PCP2 x DCP2 and TP2 x DCP2 (8 simulated CPU devices), with `--max-num-seqs` 4 or 32 and
`--max-model-len` 1,024 or 8,192, and reports the median wall time of the decode steps (after the
first five); writes DIR/pcp_gather_cost.json. With --prefill it times 256-token chunks of one
1,280-token prompt under PCP2 x DCP2 instead (DIR/pcp_prefill_cost.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

LAYOUTS = {"dp2": {"data_parallel_size": 2, "enable_expert_parallel": True},
           "pcp2xdcp2": {"prefill_context_parallel_size": 2, "decode_context_parallel_size": 2},
           "tp2xdcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}}
LIMITS = [(4, 1024), (32, 1024), (4, 8192)]  # (max_num_seqs, max_model_len)


PREFILL_LIMITS = [(4, 2048), (32, 2048), (4, 16384)]


def step_times(parallel, max_num_seqs: int, max_model_len: int, prompts: int, prompt_len: int,
               max_tokens: int) -> list[float]:
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.types import SamplingParams

    e = build_engine(EngineArgs(dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=256, num_gpu_blocks_override=200, compile_progress=False,
                                parallel=parallel, cuda_graph_sizes=[4], precompile_token_paddings=[],
                                disable_log_stats=True))
    rng = np.random.default_rng(0)
    for i in range(prompts):
        e.add_request(f"r{i}", rng.integers(10, 400, prompt_len).tolist(),
                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    times = []
    while e.has_unfinished_requests():
        t = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t)
    return times


def median_decode_ms(parallel, max_num_seqs: int, max_model_len: int) -> float:
    """Two 100-token prompts, 40 output tokens: the median decode step after the first five steps."""
    return float(np.median(step_times(parallel, max_num_seqs, max_model_len, 2, 100, 40)[5:]) * 1e3)


def median_prefill_ms(parallel, max_num_seqs: int, max_model_len: int) -> float:
    """One 1,280-token prompt in five 256-token chunks: the median of chunks 2-5 (the first
    compiles the bucket)."""
    return float(np.median(step_times(parallel, max_num_seqs, max_model_len, 1, 1280, 1)[1:5]) * 1e3)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prefill", action="store_true",
                   help="time 256-token prefill chunks of one 1,280-token prompt under PCP2 x DCP2 instead "
                        "(writes DIR/pcp_prefill_cost.json)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from sharding.mesh import ParallelConfig

    rows = []
    if args.prefill:
        for mns, mml in PREFILL_LIMITS:
            ms = median_prefill_ms(ParallelConfig(**LAYOUTS["pcp2xdcp2"]), mns, mml)
            rows.append({"layout": "pcp2xdcp2", "max_num_seqs": mns, "max_model_len": mml,
                         "median_prefill_step_ms": ms})
            print(f"pcp2xdcp2 max_num_seqs={mns:>2} max_model_len={mml:>5}: median 256-token prefill step "
                  f"{ms:6.1f} ms", flush=True)
        (args.out / "pcp_prefill_cost.json").write_text(json.dumps(rows, indent=1))
        return rows
    for name, fields in LAYOUTS.items():
        for mns, mml in LIMITS:
            ms = median_decode_ms(ParallelConfig(**fields), mns, mml)
            rows.append({"layout": name, "max_num_seqs": mns, "max_model_len": mml, "median_decode_step_ms": ms})
            print(f"{name:>10} max_num_seqs={mns:>2} max_model_len={mml:>5}: median decode step {ms:6.1f} ms",
                  flush=True)
    (args.out / "pcp_gather_cost.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
