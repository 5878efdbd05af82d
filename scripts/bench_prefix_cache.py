"""Prefix caching on the tiny checkpoint: prefill time of a long prompt cold (nothing cached) and
warm (the same prompt again, its first whole pages served from the cache), and the engine's
per-step host overhead, measured through the offline `LLM` (the server's engine).

    PYTHONPATH=. python scripts/bench_prefix_cache.py [--prompt-len 1600] [--repeats 3] [--out DIR]

Prints one line per measurement and a summary; with `--out` writes `DIR/bench_prefix_cache.json`.
Times are wall-clock seconds of `LLM.generate(..., max_tokens=1)` (the prefill plus one sample),
after a warm-up request that compiles every step bucket.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from serving.llm import LLM  # noqa: E402
from serving.types import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1600)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    llm = LLM(max_model_len=a.prompt_len + 64, max_num_seqs=4, max_num_batched_tokens=a.max_num_batched_tokens,
              enable_prefix_caching=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([[1] * a.max_num_batched_tokens], params)  # warm-up: first run of every step shape
    rng = np.random.default_rng(0)
    rows = []
    for r in range(a.repeats):
        prompt = rng.integers(10, 450, a.prompt_len).tolist()
        for kind in ("cold", "warm"):
            s0, h0 = engine.num_steps, engine.host_overhead_s
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            dt = time.perf_counter() - t0
            steps = engine.num_steps - s0
            host_ms = 1e3 * (engine.host_overhead_s - h0) / max(steps, 1)
            rows.append(dict(repeat=r, kind=kind, seconds=dt, cached_tokens=out.num_cached_tokens, steps=steps,
                             host_ms_per_step=host_ms))
            print(f"{kind}: {dt:.3f} s, cached_tokens {out.num_cached_tokens}, {steps} steps, "
                  f"host overhead {host_ms:.2f} ms/step")
    cold = statistics.median(r["seconds"] for r in rows if r["kind"] == "cold")
    warm = statistics.median(r["seconds"] for r in rows if r["kind"] == "warm")
    summary = dict(prompt_len=a.prompt_len, hit_unit=engine.prefix_cache.unit, cold_s=cold, warm_s=warm,
                   speedup=cold / warm, rows=rows)
    print(f"median prefill {a.prompt_len} tokens: cold {cold:.3f} s, warm {warm:.3f} s "
          f"({cold / warm:.1f}x faster; hits in steps of {engine.prefix_cache.unit} tokens)")
    assert engine.audit() == []
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_prefix_cache.json"), "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
