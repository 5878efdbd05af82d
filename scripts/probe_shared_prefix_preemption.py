"""Why Hybrid HiSparse preempts under shared prefixes: a diagnostic run on the tiny model (CPU).

`--concurrency` requests at a time over `--prefixes` common prompt prefixes of `--prefix-tokens`
tokens each (request i uses prefix i mod P, plus `--suffix-tokens` tokens of its own), greedy,
`--max-tokens` each, `--requests` in all (a finished request is replaced at once), on a HiSparse
engine with a `--pages`-page device pool, prefix caching and a `--host-pool-gib` host pool. At
every preemption it records the state the scheduler saw: free pages, and per running request its
MLA pages, those shared with other requests (pool refcount > 1: a prefix-cache hit), its clean
pages, what `HiSparsePolicy.releasable` offers (sole-owned clean pages only), its lease and
residency. For each group of requests sharing pages it also computes what releasing the shared
pages from every sharer together would gain: the shared pages, less a decode lease
(`dec_pages`) for each sharer that holds none (`collective_gain`).

    PYTHONPATH=. .venv/bin/python scripts/probe_shared_prefix_preemption.py --out DIR

Writes DIR/shared_prefix_preemption.json and prints one line per preemption.
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
                "collective_gain": n - sum(pol.dec_pages for rid in k if not lease.get(rid))}
               for k, n in sorted(groups.items(), key=lambda kv_: -kv_[1])]
    return {"free_pages": pool.num_free, "usable_pages": pool.num_usable_blocks, "dec_pages": pol.dec_pages,
            "victim": victim.request_id, "requests": reqs, "sharing": sharing}


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
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import numpy as np

    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.scheduler import Scheduler
    from serving.types import SamplingParams

    rng = np.random.default_rng(0)
    prefixes = [rng.integers(5, 480, args.prefix_tokens).tolist() for _ in range(args.prefixes)]
    engine = build_engine(EngineArgs(
        max_model_len=1 << (args.prefix_tokens + args.suffix_tokens + args.max_tokens).bit_length(),
        max_num_seqs=args.concurrency, max_num_batched_tokens=256, cuda_graph_sizes=[args.concurrency],
        num_gpu_blocks_override=args.pages, compile_progress=False, disable_log_stats=True, enable_prefix_caching=True,
        attention_config={"hisparse_config": {"host_pool_gib": args.host_pool_gib}}))
    events = []
    preempt = Scheduler._preempt

    def recorded(self, victim):
        events.append(snapshot(self, victim))
        return preempt(self, victim)

    Scheduler._preempt = recorded  # this process's engine only: a diagnostic hook
    added = 0

    def add():
        nonlocal added
        prompt = prefixes[added % args.prefixes] + rng.integers(5, 480, args.suffix_tokens).tolist()
        engine.add_request(f"r{added}", prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                               ignore_eos=True))
        added += 1

    t0 = time.perf_counter()
    try:
        for _ in range(min(args.concurrency, args.requests)):
            add()
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and added < args.requests:
                    add()
            steps += 1
    finally:
        Scheduler._preempt = preempt
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "steps": steps,
              "seconds": round(time.perf_counter() - t0, 1), "preemptions": engine.scheduler.num_preemptions_total,
              "pages_released": engine.hisparse.policy.num_released, "events": events}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shared_prefix_preemption.json").write_text(json.dumps(result, indent=1))
    print(f"{result['preemptions']} preemptions in {steps} steps ({result['seconds']} s); "
          f"{result['pages_released']} pages released")
    for e in events:
        full = [q for q in e["requests"] if q["residency"] == "full"]
        best = e["sharing"][0] if e["sharing"] else None
        print(f"preempt {e['victim']}: {e['free_pages']} free of {e['usable_pages']}; "
              f"{len(e['requests'])} requests, {sum(q['releasable'] for q in e['requests'])} pages releasable; "
              f"{len(full)} full requests hold {sum(q['shared_pages'] for q in full)} shared page references"
              + (f"; largest sharing group: {len(best['sharers'])} requests share {best['shared_pages']} pages, "
                 f"releasing them from all would gain {best['collective_gain']}" if best else ""))
    return result


if __name__ == "__main__":
    main()
