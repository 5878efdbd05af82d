"""Why Hybrid HiSparse preempts under shared prefixes: a diagnostic run on the tiny model (CPU).

`--concurrency` requests at a time over `--prefixes` common prompt prefixes of `--prefix-tokens`
tokens each (request i uses prefix i mod P, plus `--suffix-tokens` tokens of its own), greedy,
`--max-tokens` each, `--requests` in all (a finished request is replaced at once), on a HiSparse
engine with a `--pages`-page device pool, prefix caching and a `--host-pool-gib` host pool. At
every preemption it records the state the scheduler saw: free pages, and per running request its
MLA pages, those shared with other requests (pool refcount > 1: a prefix-cache hit), its clean
pages, what `HiSparsePolicy.releasable` offers (sole-owned clean pages only), its lease and
residency. For each group of requests sharing pages it also computes what releasing the shared
pages from every sharer together gains: the shared pages, less a decode lease (`dec_pages`) for
each sharer that holds none (`collective_gain`), and with leases squeezed to `least_pages`
(`squeezed_gain`, docs/hisparse.md "Squeezed leases").

`--modes` (default all five, one engine each, in this order):
* `ample`: no HiSparse on a pool that holds every request: the reference streams (with top-2
  logprobs for the equality rule);
* `shared`: HiSparse as the engine runs it: pages shared by running requests are released by all
  their sharers together when nothing else saves a running request from preemption
  (`HiSparsePolicy._shared_candidates`), and when even that does not make room, leases are
  squeezed to the fewest rows a decode step needs (`HiSparsePolicy._squeeze`);
* `unsqueezed`: the same without squeezed leases (the engine before them);
* `shared_admits`: the same, and shared releases also make room to admit a waiting request
  (`HiSparsePolicy.shared_release_admits`, off in the engine);
* `sole`: shared releases and squeezed leases switched off (each request releases only its own pages, the rule
  before shared releases existed): the baseline.
Every HiSparse mode's streams are compared with the ample run's under docs/design.md §10's rule.

    PYTHONPATH=. .venv/bin/python scripts/probe_shared_prefix_preemption.py --out DIR

Writes DIR/runs.jsonl (each mode's counts as it ends), DIR/shared_prefix_preemption.json and
DIR/summary.txt (one line per mode and per preemption, also printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def snapshot(scheduler, victim) -> dict:
    """The pool and every running request's MLA pages as `scheduler` preempts `victim`."""
    pol = scheduler.policy
    pool, kv = pol.kv.pool, pol.kv
    reqs = []
    holders: dict[int, list[str]] = defaultdict(list)  # shared block → running requests holding it
    for r in [*scheduler.running, victim]:
        rid = r.request_id
        if not kv.has_request(rid):
            continue
        t = kv.table(rid, pol.group)
        rec = pol.records.get(rid)
        shared = [b for i, b in enumerate(t.blocks) if t.is_owned(i) and pool.refcount(b) > 1]
        for b in shared:
            holders[b].append(rid)
        reqs.append({"request_id": rid, "computed_tokens": r.num_computed_tokens, "mla_pages": len(t.blocks),
                     "shared_pages": len(shared), "clean_pages": len(rec.host_blocks) if rec else 0,
                     "releasable": len(pol.releasable(r)), "lease": len(rec.lease) if rec else 0,
                     "residency": pol.residency(r), "victim": r is victim})
    lease = {q["request_id"]: q["lease"] for q in reqs}
    groups: dict[tuple, int] = defaultdict(int)  # sharers → shared pages
    for b, rids in holders.items():
        groups[tuple(sorted(rids))] += 1
    sharing = [{"sharers": list(k), "shared_pages": n,
                "collective_gain": n - sum(pol.dec_pages for rid in k if not lease.get(rid)),
                "squeezed_gain": n - sum(pol.least_pages for rid in k if not lease.get(rid))}
               for k, n in sorted(groups.items(), key=lambda kv_: -kv_[1])]
    return {"free_pages": pool.num_free, "usable_pages": pool.num_usable_blocks, "dec_pages": pol.dec_pages,
            "least_pages": pol.least_pages,
            "victim": victim.request_id, "requests": reqs, "sharing": sharing}


MODES = ("ample", "shared", "unsqueezed", "shared_admits", "sole")


def run(args, mode: str, prefixes, suffixes) -> dict:
    """One engine of `mode` (`MODES`) over the workload; the streams, counters and, under
    HiSparse, the state at every preemption."""
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.hisparse.residency import HiSparsePolicy
    from serving.scheduler import Scheduler
    from serving.types import SamplingParams

    ample = mode == "ample"
    max_len = args.prefix_tokens + args.suffix_tokens + args.max_tokens
    engine = build_engine(EngineArgs(
        max_model_len=1 << max_len.bit_length(),
        max_num_seqs=args.concurrency, max_num_batched_tokens=256, cuda_graph_sizes=[args.concurrency],
        # ample: every running request's pages fully resident, with room to spare
        num_gpu_blocks_override=args.concurrency * (max_len // 64 + 4) if ample else args.pages,
        compile_progress=False, disable_log_stats=True, enable_prefix_caching=True,
        attention_config={} if ample else {"hisparse_config": {"host_pool_gib": args.host_pool_gib}}))
    events = []
    preempt, shared_candidates, squeeze = Scheduler._preempt, HiSparsePolicy._shared_candidates, HiSparsePolicy._squeeze
    admits = HiSparsePolicy.shared_release_admits

    def recorded(self, victim):
        events.append(snapshot(self, victim))
        return preempt(self, victim)

    # Diagnostic hooks, this process's engine only: record each preemption; `sole` switches
    # shared releases off, `unsqueezed` squeezed leases, `shared_admits` lets shared releases admit
    # requests too.
    Scheduler._preempt = recorded
    if mode == "sole":
        HiSparsePolicy._shared_candidates = lambda self, protect, leased, cost=None: []
    if mode in ("sole", "unsqueezed"):
        HiSparsePolicy._squeeze = lambda self, req, num_new, scheduled: 0
    HiSparsePolicy.shared_release_admits = mode == "shared_admits"
    added = 0
    streams: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    prompts: dict[str, list[int]] = {}

    def add():
        nonlocal added
        rid = f"r{added}"
        prompts[rid] = prefixes[added % args.prefixes] + suffixes[added]
        streams[rid], logprobs[rid] = [], []
        engine.add_request(rid, prompts[rid], SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                             ignore_eos=True, logprobs=2 if ample else None))
        added += 1

    running: list[int] = []  # requests running after each step
    t0 = time.perf_counter()
    try:
        for _ in range(min(args.concurrency, args.requests)):
            add()
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                streams[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += out.new_logprobs or []
                if out.finished and added < args.requests:
                    add()
            steps += 1
            running.append(len(engine.scheduler.running))
    finally:
        Scheduler._preempt, HiSparsePolicy._shared_candidates = preempt, shared_candidates
        HiSparsePolicy._squeeze = squeeze
        HiSparsePolicy.shared_release_admits = admits
    pol = None if ample else engine.hisparse.policy
    return {"mode": mode, "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
            "preemptions": engine.scheduler.num_preemptions_total,
            "pages_released": pol.num_released if pol else 0,
            "pages_released_shared": pol.num_released_shared if pol else 0,
            "squeezed_steps": pol.num_squeezed_steps if pol else 0,
            "leaked_pages": engine.pool.num_usable_blocks - engine.pool.num_free,
            "mean_running": round(sum(running) / len(running), 2),
            "hot_misses": engine.hisparse.device.misses if pol else 0,
            "host_to_device_bytes": engine.hisparse.device.h2d_bytes if pol else 0,
            "events": events, "streams": streams, "logprobs": logprobs, "prompts": prompts}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=1300)
    ap.add_argument("--suffix-tokens", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--host-pool-gib", type=float, default=1.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}")

    import numpy as np

    from glm53 import api
    from glm53.equality import compare_streams

    rng = np.random.default_rng(0)
    prefixes = [rng.integers(5, 480, args.prefix_tokens).tolist() for _ in range(args.prefixes)]
    suffixes = [rng.integers(5, 480, args.suffix_tokens).tolist() for _ in range(args.requests)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs.jsonl").write_text("")
    runs = {}
    for m in modes:
        runs[m] = run(args, m, prefixes, suffixes)
        with (args.out / "runs.jsonl").open("a") as f:  # each mode's counts as it ends (a run cut short keeps them)
            f.write(json.dumps({k: v for k, v in runs[m].items() if k not in ("streams", "logprobs", "prompts")})
                    + "\n")
    lines = []
    ref = runs.get("ample")
    lm = api.load() if ref else None  # the engines' fp32 cache: the indexer diagnostic of the rule
    for m, r in runs.items():
        if ref is not None and m != "ample":
            divs = compare_streams(ref["streams"], r["streams"], ref["logprobs"], ref["prompts"], lm,
                                   strict=False, verbose=False)
            r["divergences"] = [str(d) for d in divs]
            r["unexplained"] = sum(d.accepted_by is None for d in divs)
            eq = ("every stream equal to the ample run's" if not divs else
                  f"{len(divs)} streams diverge from the ample run's, {r['unexplained']} unexplained")
        else:
            eq = "the reference" if m == "ample" else "not compared (no ample run)"
        lines.append(f"{m}: {r['preemptions']} preemptions in {r['steps']} steps ({r['seconds']} s, "
                     f"{r['mean_running']} running on average; {r['hot_misses']} hot-buffer misses, "
                     f"{r['host_to_device_bytes'] / 2**20:.1f} MiB host to device); "
                     f"{r['pages_released']} pages released by their one holder, {r['pages_released_shared']} "
                     f"by all their sharers together; {r['squeezed_steps']} request steps on a squeezed lease; "
                     f"{r['leaked_pages']} pages held at the end; {eq}")
        for e in r["events"]:
            full = [q for q in e["requests"] if q["residency"] == "full"]
            best = e["sharing"][0] if e["sharing"] else None
            lines.append(f"  preempt {e['victim']}: {e['free_pages']} free of {e['usable_pages']}; "
                         f"{len(e['requests'])} requests, {sum(q['releasable'] for q in e['requests'])} pages "
                         f"releasable; {len(full)} full requests hold {sum(q['shared_pages'] for q in full)} shared "
                         f"page references" + (
                             f"; largest sharing group: {len(best['sharers'])} requests share "
                             f"{best['shared_pages']} pages, releasing them from all would gain "
                             f"{best['collective_gain']} ({best['squeezed_gain']} with squeezed leases)"
                             if best else ""))
    for r in runs.values():
        r.pop("logprobs")
        r.pop("prompts")
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shared_prefix_preemption.json").write_text(json.dumps(result, indent=1))
    cmd = "PYTHONPATH=. .venv/bin/python scripts/probe_shared_prefix_preemption.py " + " ".join(argv or sys.argv[1:])
    (args.out / "summary.txt").write_text(f"# {cmd} ({time.strftime('%Y-%m-%d')})\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
