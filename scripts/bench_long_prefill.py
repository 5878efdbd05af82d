"""Hybrid HiSparse long prefills: a prompt longer than the device pool, served with adaptive prefill
sizing (the default), with the worst-case chunk bound (`prefill_sizing: "worst_case"`) and on an
ample pool without HiSparse, side by side in one run (docs/hisparse.md "Long prefills").

1. **Random-weight tiny model** (`tiny`): a prompt of `scale` × the MLA token capacity of the
   device pool, for each `--scales` entry: the smallest pool of at least 25 pages that admits it
   (its indexer pages, the in-flight window and the prefill lease must fit, with a page spare:
   25 pages = 1,536 MLA tokens at 3×, 31 pages = 1,920 at 6×); `prefill_buffer_size` 640 (10 query
   rows in the worst case), budget 64 tokens a step, 16 greedy output tokens. Modes: adaptive,
   worst case, and adaptive with lease growth (`adaptive_grow`: `prefill_buffer_max_size` = the
   whole pool's rows, so the lease takes whatever pages are free).
2. **Trained model** (`tiny-recall`, `--recall`): four held-out retrieval prompts of ≈ 1,000
   tokens (glm53/recall_tasks.py) one after the other on a 12-page pool (a prompt needs 16 MLA
   pages), `prefill_buffer_size` 128 (2 rows in the worst case), budget 256, 8 output tokens; the
   answers are checked against the task's expected values.

3. **Lease sweep** (`--lease-sweep POOL[xSCALE]:ROWS[-MAX][/MECHANISM][@BUDGET],...`, off by default):
   the random-weight prompt of SCALE (default 3) × the MLA token capacity of a POOL-page pool,
   ample and then under adaptive sizing at each
   `prefill_buffer_size` ROWS (growing into free pages up to `prefill_buffer_max_size` MAX; and
   `host_gather` mechanism; BUDGET tokens a step instead of 64): a larger lease takes more query rows a step, so fewer steps, but each
   step then resolves and copies more rows. The measurement behind docs/hisparse.md "Long
   prefills" on the lease's size:

       PYTHONPATH=. .venv/bin/python scripts/bench_long_prefill.py --no-recall --scales "" \
           --lease-sweep 50:640,1280,1856,640-3136,640/callback,1856/callback \
           --out docs/results/hisparse_long_prefill/lease_sweep

Per run: wall seconds of the long request(s) (engines built and compiled before the clock
starts), engine steps, hot steps, the median wall time of a hot and of a plain step, truncated
chunks and the rows computed again, steps with a grown lease, hot hits and
misses, the greedy tokens' equality with the ample run (the tiny model's under docs/design.md
§10's rule, `glm53.equality`), and the ratio to the ample pool's time.

    PYTHONPATH=. .venv/bin/python scripts/bench_long_prefill.py --out docs/results/hisparse_long_prefill

`--token-paddings 16,32` gives the random-prompt engines a 32-token step program besides the
16-token one and the 64-token budget (docs/hisparse.md "Long prefills",
`token_paddings_16_32/`: `--no-recall --scales 3,6 --token-paddings 16,32`).

`--ample-budgets 16,256` adds, for each random prompt, runs on the ample pool at those step token
budgets (modes `ample_16`, `ample_256`: is the 64-token budget the baseline's best?); with 16 (the
smallest step program) each HiSparse run gets `floor_seconds`: each of its
hot steps at the median time of a plain step of the same program on the ample pool (16 tokens
from `ample_16`, 64 from `ample`), plus its plain steps' time — what the run would take if the
hot path (the resolver, the host copies) cost nothing — and `floor_vs_ample` (docs/hisparse.md
"What bounds it now").

Writes OUT/rows.jsonl (each row as it is measured), OUT/summary.json and prints the table.
Measured on whatever the machine is doing: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from glm53 import api, recall_tasks
from glm53.equality import compare_streams
from glm53.hub import resolve_model
from glm53.tokenizer import GlmTokenizer
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.llm import LLM
from serving.types import SamplingParams

MIN_POOL, MLA_TPP, INDEXER_TPP = 25, 64, 768
WINDOW_PAGES = 2 + 2 + 640 // 64  # two chunk pages, two tail pages, the prefill lease


def pool_for(scale: float) -> int:
    """The smallest pool (pages, null page included) of at least MIN_POOL pages whose in-flight
    window admits a prompt of `scale` × its MLA token capacity."""
    pages = MIN_POOL
    while -(-int(scale * (pages - 1) * MLA_TPP) // INDEXER_TPP) + WINDOW_PAGES > pages - 2:  # a page spare
        pages += 1
    return pages
AMPLE_BUDGETS: list[int] = []  # --ample-budgets: the ample pool also at these step token budgets
TOKEN_PADDINGS: list[int] | None = None  # --token-paddings (None: the engine's default buckets)
ROWS_LOG: Path | None = None  # OUT/rows.jsonl: each row as it is measured (a run cut short keeps them)


def log_row(row: dict) -> None:
    if ROWS_LOG is not None:
        with ROWS_LOG.open("a") as f:
            f.write(json.dumps(row) + "\n")


MODES = {"ample": None, "adaptive": "adaptive", "worst_case": "worst_case"}


def counters(e, mode, dt, steps0, hot0):
    row = {"mode": mode, "seconds": round(dt, 2), "steps": e.num_steps - steps0,
           "hot_steps": e.runner.num_hot_steps - hot0}
    if e.hisparse is not None:
        pol, d = e.hisparse.policy, e.hisparse.device
        row.update(truncated_chunks=pol.num_truncated_chunks, rows_recomputed=pol.num_truncated_rows,
                   grown_steps=pol.num_grown_steps,
                   hot_hits=d.hits, hot_misses=d.misses, drops_outside_truncation=d.drops_outside_truncation,
                   preemptions=e.scheduler.num_preemptions_total)
    return row


def random_prompt_run(scale: float, lm, pool: int | None = None, runs=None) -> list[dict]:
    """The random-weight prompt of `scale` × the MLA token capacity of `pool` pages (default
    `pool_for(scale)`), on an ample pool and then under each of `runs`: (mode name, the
    `hisparse_config` overrides; default the adaptive and worst-case sizings at
    `prefill_buffer_size` 640)."""
    pool = pool or pool_for(scale)
    n = int(scale * (pool - 1) * MLA_TPP)
    prompt = np.random.default_rng(7).integers(10, 490, n).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    if runs is None:
        runs = [(mode, {"prefill_buffer_size": 640, "prefill_sizing": sizing})
                for mode, sizing in MODES.items() if sizing is not None]
        # ... and adaptive with the lease growing into the pool's free pages (at most the whole pool)
        runs.append(("adaptive_grow", {"prefill_buffer_size": 640, "prefill_buffer_max_size": (pool - 1) * MLA_TPP}))
    rows, ref = [], None
    plain_by_bucket: dict[str, dict[int, list[float]]] = {}  # ample runs: step program → plain steps' seconds
    floor_runs = [(f"ample_{b}", None) for b in AMPLE_BUDGETS]
    for mode, overrides in [("ample", None), *floor_runs, *runs]:
        overrides = None if overrides is None else dict(overrides)
        budget = int(mode.split("_")[1]) if mode.startswith("ample_") else (overrides or {}).pop("_budget", 64)
        hs = None if overrides is None else {"hisparse_config": {"host_pool_gib": 0.05 * max(1.0, scale / 3, pool / 25),
                                                                 **overrides}}
        blocks = 2 * -(-n // 64) + 16 if overrides is None else pool
        e = build_engine(EngineArgs(max_model_len=n + 64, max_num_seqs=4, max_num_batched_tokens=budget,
                                    cuda_graph_sizes=[], num_gpu_blocks_override=blocks, kv_cache_dtype="bfloat16",
                                    compile_progress=False, disable_log_stats=True, enable_prefix_caching=True,
                                    attention_config=hs, precompile_token_paddings=TOKEN_PADDINGS))
        steps0, hot0 = e.num_steps, e.runner.num_hot_steps
        e.add_request("long", prompt, params)
        toks, lps = [], []
        step_s = {True: [], False: []}  # hot / plain steps' wall seconds
        hot_buckets = []  # each hot step's padded token count (its step program)
        t = time.perf_counter()
        while e.has_unfinished_requests():
            h, t1 = e.runner.num_hot_steps, time.perf_counter()
            for o in e.step():
                toks += o.new_token_ids
                lps += o.new_logprobs or []
            hot, dt = e.runner.num_hot_steps > h, time.perf_counter() - t1
            step_s[hot].append(dt)
            if hot:
                hot_buckets.append(e.runner.last.padded_tokens)
            elif overrides is None and e.runner.last is not None:
                plain_by_bucket.setdefault(mode, {}).setdefault(e.runner.last.padded_tokens, []).append(dt)
        row = counters(e, mode, time.perf_counter() - t, steps0, hot0)
        row.update({f"{k}_step_ms_median": round(1e3 * float(np.median(v)), 1)
                    for k, v in (("hot", step_s[True]), ("plain", step_s[False])) if v})
        row.update(hot_seconds=round(sum(step_s[True]), 2), plain_seconds=round(sum(step_s[False]), 2))
        if overrides is not None and floor_runs:
            # every hot step at the median cost of a plain step of its program on the ample pool
            # (the 16-token program from ample_16, the 64-token one from ample): what the run would
            # take if the hot path (the resolver, the host copies) cost nothing
            ref_ms = {}
            for by in plain_by_bucket.values():  # the ample run with the most steps of each program
                for b, v in by.items():
                    if len(v) > len(ref_ms.get(b, ())):
                        ref_ms[b] = v
            if all(b in ref_ms for b in hot_buckets):
                row["floor_seconds"] = round(sum(float(np.median(ref_ms[b])) for b in hot_buckets)
                                             + row["plain_seconds"], 2)
                row["hot_step_programs"] = {str(b): hot_buckets.count(b) for b in sorted(set(hot_buckets))}
        row.update(model="tiny", prompt_tokens=n, pool_pages=pool, pool_multiple=scale)
        if overrides is not None:
            row["prefill_buffer_size"] = overrides.get("prefill_buffer_size")
            row["prefill_buffer_max_size"] = overrides.get("prefill_buffer_max_size")
            row["max_num_batched_tokens"] = budget
            row["host_to_device_bytes"] = e.hisparse.device.h2d_bytes
        if mode.startswith("ample_"):
            pass  # another chunking of the same prompt: its stream is not compared
        elif ref is None:
            ref = (toks, lps)
        else:
            row["tokens_equal"] = toks == ref[0]
            if not row["tokens_equal"]:  # raises unless the divergence is a near-tie (the rule)
                compare_streams({"long": ref[0]}, {"long": toks}, {"long": ref[1]}, {"long": prompt}, lm)
                row["tokens_equal"] = "under the rule"
        rows.append(row)
        print(row, flush=True)
        log_row(row)
    return rows


def recall_run() -> list[dict]:
    path = resolve_model("tiny-recall")
    tok = GlmTokenizer.from_pretrained(path)
    rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + 4242)
    samples = [recall_tasks.retrieval_sample(rng, tok, 1024) for _ in range(4)]
    common = {"max_model_len": 1224, "max_num_seqs": 4, "max_num_batched_tokens": 256}
    chat = {"chat_template_kwargs": {"enable_thinking": False}}
    rows, ref = [], None
    for mode, sizing in MODES.items():
        hs = None if sizing is None else {"hisparse_config": {"host_pool_gib": 0.02, "prefill_buffer_size": 128,
                                                              "prefill_sizing": sizing}}
        llm = LLM("tiny-recall", dtype="float32", kv_cache_dtype="bfloat16", cuda_graph_sizes=[],
                  compile_progress=False, num_gpu_blocks_override=80 if sizing is None else 12,
                  enable_prefix_caching=True, attention_config=hs, **common)
        e = llm.engine
        steps0, hot0 = e.num_steps, e.runner.num_hot_steps
        t = time.perf_counter()
        answers = []
        for s in samples:  # one at a time: each is a long prefill
            out = llm.chat([s.messages], SamplingParams(temperature=0, max_tokens=8), **chat)
            answers.append(out[0].outputs[0].text.strip())
        row = counters(e, mode, time.perf_counter() - t, steps0, hot0)
        row.update(model="tiny-recall", prompt_tokens=max(s.prompt_tokens for s in samples),
                   right=sum(a == s.answer for a, s in zip(answers, samples)), requests=len(samples))
        if ref is None:
            ref = answers
        else:
            row["tokens_equal"] = answers == ref
        rows.append(row)
        print(row, flush=True)
        log_row(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scales", default="3,6", help="prompt lengths in multiples of the pool's MLA token capacity")
    ap.add_argument("--recall", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--lease-sweep", metavar="POOL[xSCALE]:ROWS[-MAX][/MECHANISM][@BUDGET],...", default="",
                    help="also the SCALE x (default 3x) prompt of a POOL-page pool under adaptive sizing at each prefill_buffer_size "
                         "(rows; growing into free pages up to prefill_buffer_max_size MAX; host_gather MECHANISM, "
                         "default memory_kind): how the lease's size trades steps for the cost of a step")
    ap.add_argument("--token-paddings", default="",
                    help="the random-prompt engines' prefill step buckets (e.g. 16,32; default the engine's "
                         "16·4^k), besides the 64-token budget")
    ap.add_argument("--ample-budgets", default="",
                    help="also run the random prompts on the ample pool at these step token budgets (modes "
                         "ample_B; e.g. 16,256); with 16 each HiSparse run gets a floor_seconds: its hot steps at "
                         "the ample pool's median plain step of the same program plus its plain steps' time")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global ROWS_LOG, TOKEN_PADDINGS
    AMPLE_BUDGETS[:] = [int(x) for x in args.ample_budgets.split(",") if x]
    if args.token_paddings:
        TOKEN_PADDINGS = [int(x) for x in args.token_paddings.split(",")]
    ROWS_LOG = args.out / "rows.jsonl"
    ROWS_LOG.write_text("")
    lm = api.load(cache_dtype="bfloat16")
    rows = []
    for scale in (float(s) for s in args.scales.split(",") if s):
        rows += random_prompt_run(scale, lm)
    if args.recall:
        rows += recall_run()
    if args.lease_sweep:
        pool, entries = args.lease_sweep.split(":")
        pool, _, scale = pool.partition("x")
        runs = []
        for entry in entries.split(","):
            entry, _, budget = entry.partition("@")
            size, _, mechanism = entry.partition("/")
            size, _, grow = size.partition("-")
            name = f"adaptive lease {size}{f' growing to {grow}' if grow else ''} {mechanism or 'memory_kind'}"
            runs.append((name + (f" budget {budget}" if budget else ""),
                         {"prefill_buffer_size": int(size), "host_gather": mechanism or "memory_kind",
                          **({"prefill_buffer_max_size": int(grow)} if grow else {}),
                          **({"_budget": int(budget)} if budget else {})}))
        rows += random_prompt_run(float(scale or 3), lm, int(pool), runs)
    ample = {}
    for r in rows:
        key = (r["model"], r.get("prompt_tokens"), r.get("pool_pages"))
        if r["mode"] == "ample":
            ample[key] = r["seconds"]
        r["time_vs_ample"] = round(r["seconds"] / ample[key], 2)
        if "floor_seconds" in r:
            r["floor_vs_ample"] = round(r["floor_seconds"] / ample[key], 2)
    (args.out / "summary.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    cols = ["model", "prompt_tokens", "pool_pages", "pool_multiple", "mode", "seconds", "time_vs_ample", "steps",
            "hot_steps", "hot_step_ms_median", "plain_step_ms_median", "hot_misses", "truncated_chunks",
            "rows_recomputed", "grown_steps", "floor_vs_ample", "tokens_equal", "right"]
    print(",".join(cols))
    for r in rows:
        print(",".join(str(r.get(c, "")) for c in cols))


if __name__ == "__main__":
    main()
