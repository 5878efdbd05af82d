"""What presence / frequency / repetition penalties and `logit_bias` cost per engine step: the same
requests served with and without them, side by side in one engine, rounds alternating.

    PYTHONPATH=. .venv/bin/python scripts/bench_penalties.py --out DIR [--model DIR] [--rounds 3]

One engine (the embedded tiny checkpoint unless `--model`), `--batch` greedy requests of
`--prompt-tokens` random tokens and `--max-tokens` outputs each (ignore_eos), served to the end in
each mode: `none`; `logit_bias` (8 biased ids, no output counts: the step runs split, nothing
deferred); `presence_frequency` (the output's counts); `repetition` (the prompt's distinct ids
too: the widest lists). With `--async-scheduling` the engine schedules asynchronously (the
penalties' steps then defer their sampler). Every mode runs once untimed first (its programs
compile), then `--rounds` timed rounds in turn. Reports, per mode, the median over rounds of the
seconds per engine step (wall time of `step()` calls / steps) and its ratio to `none`, and writes
`DIR/bench_penalties.json`. CPU numbers vary ±15 % between runs; only the side-by-side ratios of
one run mean anything.

`--host-cost` instead times the host side alone for one long request (a repetition and a frequency
penalty; GLM-5.3's vocabulary size): bringing its kept list (`serving.penalties.PenaltyState`) up
to date with one new token and reading its entries, against building the list from scratch each
step (a Counter of the output and a set of the prompt: what a step would cost without the kept
state), per step, for a few prompt and output lengths.
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

MODES = {
    "none": {},
    "logit_bias": {"logit_bias": {int(t): 0.5 for t in range(20, 28)}},
    "presence_frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "repetition": {"repetition_penalty": 1.2},
}


def serve(engine, prompts, max_tokens: int, adjust: dict, tag: str) -> tuple[float, int]:
    from serving.types import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                           **adjust))
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def host_cost(out: str) -> dict:
    """The host side's time per step for one long request, kept list against a rebuild."""
    import collections

    from serving.penalties import PenaltyState
    from serving.request import Request
    from serving.types import SamplingParams

    rng = np.random.default_rng(0)
    rows = []
    for P, O in ((4096, 4096), (32768, 16384), (131072, 32768)):
        req = Request("r", rng.integers(0, 154880, P).tolist(),
                      SamplingParams(repetition_penalty=1.1, frequency_penalty=0.3))
        req.output_token_ids = rng.integers(0, 154880, O).tolist()
        state = PenaltyState(req)
        state.update(req.output_token_ids[:-1])
        t0, n = time.perf_counter(), 50
        for _ in range(n):
            state.counted = O - 1  # the last token is the step's new one
            state.update(req.output_token_ids)
            state.entries()
        kept = (time.perf_counter() - t0) / n
        t0, n = time.perf_counter(), 3
        for _ in range(n):
            counts, prompt = collections.Counter(req.output_token_ids), set(req.prompt_token_ids)
            ids = np.asarray(sorted(set(counts) | prompt), np.int32)
            np.asarray([counts.get(int(i), 0) for i in ids], np.int32), np.isin(ids, list(prompt))
        rebuild = (time.perf_counter() - t0) / n
        rows.append({"prompt_tokens": P, "output_tokens": O, "entries": len(state.ids),
                     "kept_ms": round(1000 * kept, 4), "rebuild_ms": round(1000 * rebuild, 2)})
        print(f"prompt {P:>6}, output {O:>6}: {len(state.ids):>6} entries; kept list {1000 * kept:.3f} ms/step, "
              f"rebuilt {1000 * rebuild:.1f} ms/step")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "host_cost.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return {"host_cost": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--host-cost", action="store_true", help="time the host side alone (see above)")
    args = ap.parse_args(argv)
    if args.host_cost:
        return host_cost(args.out)
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine

    engine = build_engine(EngineArgs(model=args.model, max_model_len=args.prompt_tokens + args.max_tokens + 64,
                                     max_num_seqs=args.batch, max_num_batched_tokens=256, compile_progress=False,
                                     disable_log_stats=True, async_scheduling=args.async_scheduling))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 400, args.prompt_tokens).tolist() for _ in range(args.batch)]
    for mode, adj in MODES.items():  # compile every mode's programs before timing
        serve(engine, prompts, args.max_tokens, adj, f"warm-{mode}")
    per_step = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            s, steps = serve(engine, prompts, args.max_tokens, MODES[mode], f"r{r}-{mode}")
            per_step[mode].append(s / steps)
    base = statistics.median(per_step["none"])
    result = {"args": vars(args), "deferred_samples": engine.runner.num_deferred_samples,
              "modes": {m: {"ms_per_step": [round(1000 * x, 3) for x in v],
                            "median_ms": round(1000 * statistics.median(v), 3),
                            "ratio_to_none": round(statistics.median(v) / base, 3)} for m, v in per_step.items()}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_penalties.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'mode':<20} {'ms/step (median)':>17} {'x none':>7}   per round")
    for m, r in result["modes"].items():
        print(f"{m:<20} {r['median_ms']:>17.2f} {r['ratio_to_none']:>7.3f}   {r['ms_per_step']}")
    print(f"wrote {os.path.join(args.out, 'bench_penalties.json')}")
    return result


if __name__ == "__main__":
    main()
