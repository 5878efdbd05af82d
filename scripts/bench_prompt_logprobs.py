"""What prompt logprobs (`prompt_logprobs`, completions' `echo` with `logprobs`) cost: the same
prompts scored with and without them, side by side in one engine, rounds alternating.

    PYTHONPATH=. .venv/bin/python scripts/bench_prompt_logprobs.py --out DIR [--model DIR] [--rounds 3]

One engine (the embedded tiny checkpoint unless `--model`; prefix caching off, so both modes
compute every prompt token), `--batch` requests of `--prompt-tokens` random tokens and one greedy
output token each (what a scoring request is), served to the end in each mode: `none`, and
`prompt_logprobs` with k = 0 (the prompt token's logprob and rank: lm-evaluation-harness's
loglikelihood) and k = `--k`. Every mode runs once untimed first (its programs compile), then
`--rounds` timed rounds in turn, synchronous and then with asynchronous scheduling. Reports per
mode the median over rounds of the wall seconds to serve the batch and the ratio to `none`, and
writes `DIR/bench_prompt_logprobs.json`. CPU numbers vary ±15 % between runs; only the
side-by-side ratios of one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def serve(engine, prompts, prompt_logprobs: int | None, tag: str) -> tuple[float, int]:
    """Serve `prompts` (one greedy token each) to the end → (wall seconds, engine steps)."""
    from serving.types import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=prompt_logprobs))
    steps, t0 = 0, time.perf_counter()
    got = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got += o.prompt_logprobs is not None
        steps += 1
    if prompt_logprobs is not None and got != len(prompts):
        raise RuntimeError(f"{got} of {len(prompts)} requests returned prompt logprobs")
    return time.perf_counter() - t0, steps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny checkpoint)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--k", type=int, default=5, help="alternatives of the second prompt_logprobs mode")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine

    os.makedirs(args.out, exist_ok=True)
    engine = build_engine(EngineArgs(model=args.model, max_model_len=args.prompt_tokens + 16, max_num_seqs=args.batch,
                                     max_num_batched_tokens=args.max_num_batched_tokens, cuda_graph_sizes=[],
                                     precompile_token_paddings=[], compile_progress=False, disable_log_stats=True))
    vocab = engine.runner.sampling_vocab_size
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, vocab, args.prompt_tokens)] for _ in range(args.batch)]
    modes = {"none": None, "prompt_logprobs_0": 0, f"prompt_logprobs_{args.k}": args.k}
    result = {"batch": args.batch, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
              "max_num_batched_tokens": args.max_num_batched_tokens, "model": args.model or "tiny"}
    for sched in ("sync", "async"):
        engine.set_async_scheduling(sched == "async")
        for name, k in modes.items():  # compile every program the mode needs
            serve(engine, prompts, k, f"warm-{sched}-{name}")
        times = {name: [] for name in modes}
        steps = {}
        for r in range(args.rounds):
            for name, k in modes.items():
                s, n = serve(engine, prompts, k, f"{sched}-{r}-{name}")
                times[name].append(s)
                steps[name] = n
        base = statistics.median(times["none"])
        result[sched] = {name: {"seconds": statistics.median(t), "rounds": t, "steps": steps[name],
                                "ratio": statistics.median(t) / base} for name, t in times.items()}
        for name, v in result[sched].items():
            print(f"{sched:5s} {name:20s} {v['seconds']:.3f} s ({v['steps']} steps)  x{v['ratio']:.3f}  "
                  f"rounds {', '.join(f'{x:.3f}' for x in v['rounds'])}")
    with open(os.path.join(args.out, "bench_prompt_logprobs.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
