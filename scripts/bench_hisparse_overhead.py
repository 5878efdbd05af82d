"""What Hybrid HiSparse costs without pressure: decode-step time of a HiSparse engine whose pool holds
everything next to the same engine without HiSparse, measured interleaved in one run.

    PYTHONPATH=. .venv/bin/python scripts/bench_hisparse_overhead.py --out DIR [--requests 8]

Both engines (tiny checkpoint, the agentic --quick sizes: 95 pages, chunk 1,024, 2,318-token
prompts) serve the same requests one at a time, alternating which engine goes first, and every
batch-1 decode step is timed (engine `step()` wall time, and its device part:
`ModelRunner.last.device_s`). The issue's requirement: with no pressure the engine performs as
without HiSparse; a step with no hot lease runs the plain program (`ModelRunner.execute`). Prints
the medians and writes `DIR/hisparse_overhead.json`. CPU numbers vary ±15 % between runs of the
same engine; only the side-by-side ratio of one run means anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> dict:
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.types import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def engine(attention_config=None):
        return build_engine(EngineArgs(
            max_model_len=2761, max_num_seqs=10, max_num_batched_tokens=1024, num_gpu_blocks_override=95,
            compile_progress=False, disable_log_stats=True, enable_prefix_caching=True,
            attention_config=attention_config))

    engines = {"baseline": engine(), "hisparse": engine({"hisparse_config": {"host_pool_gib": 0.5}})}
    steps = {k: [] for k in engines}
    rng = np.random.default_rng(0)
    for r in range(args.requests):
        prompt = rng.integers(10, 400, 2318).tolist()
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        for name, e in order:
            e.add_request(f"r{r}", prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
            while e.has_unfinished_requests():
                t = time.perf_counter()
                e.step()
                dt = time.perf_counter() - t
                if e.runner.last.num_tokens == 1 and r > 0:  # batch-1 decode steps; request 0 warms up
                    steps[name].append((dt, e.runner.last.device_s))
    res = {}
    for name, v in steps.items():
        a = np.asarray(v)
        res[name] = {"decode_steps": len(a), "step_ms_median": round(float(np.median(a[:, 0])) * 1e3, 3),
                     "device_ms_median": round(float(np.median(a[:, 1])) * 1e3, 3)}
    hs = engines["hisparse"]
    res["hisparse"]["hot_steps"] = hs.runner.num_hot_steps
    res["ratio_step"] = round(res["hisparse"]["step_ms_median"] / res["baseline"]["step_ms_median"], 3)
    print(json.dumps(res, indent=1))
    (args.out / "hisparse_overhead.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
