"""Why a HiSparse engine runs fewer requests than its planner while requests wait (issue #29).

The quick agentic benchmark's workload (`scripts/bench_agentic.py --quick`: 13-turn conversations
of 2,318 / 24 / 7 tokens, a 95-page pool, the same HiSparse pool and connector budget) driven
through the engine itself, with no HTTP and no client gap: `--concurrency` conversations are open
at a time (2 × that many in all), and a conversation's next turn is added in the step its previous
turn finishes, so the offered load stays above what the pool holds and only the engine decides how
many requests run (with asynchronous scheduling, as the server runs it).

As each step is built it records the running and waiting requests and, when a request waited while
fewer than `--max-num-seqs` ran, what stopped admission in that step:

* `budget`: the step's token budget was spent (a running prefill chunk took it);
* `memory`: the policy refused the waiting request (`HiSparsePolicy.admit` returned 0): then the
  pool state is recorded too (free pages, what the running requests could release, each running
  request's residency, pages, lease, and the pages the refused request needed);
* `other` (nothing admitted for another reason, e.g. a preemption in the step).

`--mode preemption` runs the device-resident baseline (`bench_agentic`'s preemption mode) on the
same pool and workload: the engine-isolated reference for HiSparse's running requests.

At 4fa4d1f (an experiment since taken out, docs/hisparse.md "Reaching the planner")
`--hisparse-config '{"yield_prefill_leases": false}'` ran the engine without prefill leases giving
way to a waiting first turn.

Prints the mean running requests over the steps with a waiting request, split by reason, next to
the planner's steady-state count for the final context (`predict_hisparse_requests`, as
`bench_agentic.predicted`), and writes `OUT/admission.json` (the counts, every step's running /
waiting / reason, the pool at the first 50 refusals with fewer requests running than the planner).

    PYTHONPATH=. .venv/bin/python scripts/probe_hisparse_admission.py --out /tmp/adm   # ≈ 1.5 min on 2 cores
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_agentic import (  # noqa: E402
    Workload,
    chunk_tokens,
    host_budget,
    offload_connector,
    pool_sizes,
    predicted,
    user_tokens,
)

from serving.block_pool import NULL_BLOCK  # noqa: E402


def pool_state(policy, refused, need_pages: int | None) -> dict:
    """The HiSparse pool when `refused` was not admitted."""
    kv = policy.kv
    reqs = []
    for req in policy.running:
        rid = req.request_id
        rec = policy.records.get(rid)
        reqs.append(dict(
            id=rid, tokens=req.num_tokens, computed=req.num_computed_tokens, residency=policy.residency(req),
            device_pages=sum(len([b for b in kv.table(rid, g.name).blocks if b != NULL_BLOCK]) for g in kv.groups)
            if kv.has_request(rid) else 0,
            lease=len(rec.lease) if rec else 0, releasable=len(policy.releasable(req)) if rec else 0,
            pending_copies=len(rec.pending) if rec else 0))
    return dict(refused=refused.request_id, refused_tokens=refused.num_tokens, need_pages=need_pages,
                free_pages=kv.pool.num_free, usable_pages=kv.pool.num_usable_blocks,
                room=policy._room(set()), running=reqs)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scale", type=float, default=32)
    ap.add_argument("--turns", type=int, default=13)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--baseline-contexts", type=int, default=2)
    ap.add_argument("--mode", choices=("hisparse", "preemption"), default="hisparse")
    ap.add_argument("--hisparse-config", default="{}", help="extra hisparse_config keys (JSON)")
    args = ap.parse_args(argv)

    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.types import SamplingParams

    wl = Workload.scaled(args.scale, args.turns)
    c = args.concurrency
    cfg, layout, _, small, _ = pool_sizes(wl, args.baseline_contexts, c, "float32")
    mla = layout.group("mla")
    budget = chunk_tokens(args.scale)
    host = host_budget(wl, c, cfg, mla, json.loads(args.hisparse_config), budget)
    hs = host["hs"]
    max_num_seqs = max(c, 2)
    eargs = EngineArgs(
        max_model_len=wl.final_context + 64, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        num_gpu_blocks_override=small, enable_prefix_caching=True, compile_progress=False, disable_log_stats=True,
        async_scheduling=None,  # the server's default: on where the engine can
        attention_config={"hisparse_config": hs} if args.mode == "hisparse" else None,
        kv_transfer_config=offload_connector(host["host_total"] // 4) if args.mode == "hisparse" else None)
    engine = build_engine(eargs)
    sched = engine.scheduler
    policy = sched.policy
    pred = predicted(args.mode, layout, small, wl, host["planner"], c, max_num_seqs, host["host_blocks"])

    refusals: list = []
    admit = policy.admit

    def recorded_admit(req, hit, num_new, scheduled):
        n = admit(req, hit, num_new, scheduled)
        if n == 0:
            need = None
            if hasattr(policy, "_lease_pages"):
                need = sum(math.ceil(req.num_tokens / g.tokens_per_page) for g in policy.kv.groups)
            refusals.append(pool_state(policy, req, need) if hasattr(policy, "records") else
                            dict(refused=req.request_id, free_pages=policy.kv.pool.num_free,
                                 running=[r.request_id for r in sched.running]))
        return n

    policy.admit = recorded_admit  # this engine only: a diagnostic hook
    outs_seen: list = [None]
    schedule = sched.schedule

    def recorded_schedule():
        outs_seen[0] = out = schedule()
        out.probe_counts = (len(sched.running), len(sched.waiting))  # the step as built
        return out

    sched.schedule = recorded_schedule
    vocab = 400
    convs = collections.deque(range(2 * c))
    state: dict[str, tuple[int, int, list[int]]] = {}  # request id → (conversation, turn, prompt)
    generated: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=wl.out, ignore_eos=True)

    def add(conv: int, turn: int, prompt: list[int]) -> None:
        rid = f"c{conv}t{turn}"
        state[rid] = (conv, turn, prompt)
        engine.add_request(rid, prompt, params)

    for _ in range(c):
        conv = convs.popleft()
        add(conv, 0, user_tokens(conv, 0, wl.first, vocab))
    steps, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        before = len(refusals)
        outs = engine.step()
        last = outs_seen[0]
        n_run, n_wait = last.probe_counts if last is not None else (len(sched.running), len(sched.waiting))
        reason = None
        if n_wait and n_run < max_num_seqs:
            if len(refusals) > before:
                reason = "memory"
            else:
                reason = "budget" if last is None or last.num_scheduled_tokens >= budget else "other"
        steps.append(dict(running=n_run, waiting=n_wait, reason=reason))
        for out in outs:
            generated.setdefault(out.request_id, []).extend(out.new_token_ids)
            if not out.finished:
                continue
            conv, turn, prompt = state.pop(out.request_id)
            if turn + 1 < wl.turns:
                add(conv, turn + 1, prompt + generated.pop(out.request_id) + user_tokens(conv, turn + 1, wl.later,
                                                                                         vocab))
            elif convs:
                nxt = convs.popleft()
                add(nxt, 0, user_tokens(nxt, 0, wl.first, vocab))
    wall = time.perf_counter() - t0
    waiting = [s for s in steps if s["reason"] is not None]
    by = collections.Counter(s["reason"] for s in waiting)
    mean = lambda xs: round(statistics.mean(xs), 3) if xs else None  # noqa: E731
    result = dict(
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        workload=dict(first=wl.first, later=wl.later, out=wl.out, turns=wl.turns, final_context=wl.final_context),
        pool_pages=small, predicted_running=pred, steps=len(steps), seconds=round(wall, 1),
        preemptions=sched.num_preemptions_total,
        mean_running=mean([s["running"] for s in steps if s["running"]]),
        mean_running_while_waiting=mean([s["running"] for s in waiting]),
        waiting_steps_by_reason=dict(by),
        mean_running_by_reason={r: mean([s["running"] for s in waiting if s["reason"] == r]) for r in by},
        memory_steps_by_running=dict(sorted(collections.Counter(s["running"] for s in waiting
                                                                if s["reason"] == "memory").items())),
        released=getattr(policy, "num_released", None), revived=getattr(policy, "num_revived", None),
        num_refusals=len(refusals), steps_detail=steps,
        # the pool at the first 50 refusals with fewer requests running than the planner's count
        refusals_below_planner=[f for f in refusals if len(f["running"]) < pred][:50])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "admission.json").write_text(json.dumps(result))
    print(f"{args.mode} {json.loads(args.hisparse_config) or ''}: planner {pred}; "
          f"{len(steps)} steps ({wall:.0f} s), preemptions {result['preemptions']}; "
          f"mean running {result['mean_running']}, while a request waited {result['mean_running_while_waiting']} "
          f"over {len(waiting)} steps: " + ", ".join(f"{r} {n} steps (mean running {result['mean_running_by_reason'][r]})"
                                                     for r, n in by.items()))
    return result


if __name__ == "__main__":
    main()
