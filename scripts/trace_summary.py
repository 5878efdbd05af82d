"""Summarise a jax.profiler run (what `POST /stop_profile` answers, docs/gpu_deployment.md): the
engine steps' wall times and, per process of the trace (a GPU, the host), the events that took
the most time, from the run's `perfetto_trace.json.gz`.

    PYTHONPATH=. .venv/bin/python scripts/trace_summary.py RUN_DIR [--top 25] [--out summary.json]

`steps`: the `engine_step` annotations (serving/async_engine.py) — count, and p50 / p90 / max
milliseconds. `by_process`: for each trace process (`/device:GPU:0`, `/host:CPU`, …) the `top`
event names by total duration, with counts; on a GPU those are the XLA kernels (fusions, custom
calls such as the Pallas kernels), on the CPU backend the thunks and thread-pool work. Durations
of nested events overlap (a step contains its kernels): compare names within one process.
Prints a table and writes the JSON to `--out` when given.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def summarize(run_dir: str | Path, top: int = 25) -> dict:
    """The summary of one run directory (see the module docstring). Raises FileNotFoundError when
    the run has no Perfetto trace (it was taken with `create_perfetto_trace: false`)."""
    path = Path(run_dir) / "perfetto_trace.json.gz"
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    steps_ms: list[float] = []
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.get("ph") != "X":
            continue
        dur_ms = float(e.get("dur", 0.0)) / 1000.0  # the trace's durations are in microseconds
        if e.get("name") == "engine_step":
            steps_ms.append(dur_ms)
        slot = totals[names.get(e.get("pid"), str(e.get("pid")))][e.get("name", "?")]
        slot[0] += dur_ms
        slot[1] += 1
    steps = {"count": len(steps_ms)}
    if steps_ms:
        steps.update(p50_ms=round(_percentile(steps_ms, 0.5), 3), p90_ms=round(_percentile(steps_ms, 0.9), 3),
                     max_ms=round(max(steps_ms), 3), total_ms=round(sum(steps_ms), 3))
    by_process = {
        proc: [{"name": n, "total_ms": round(t, 3), "count": c}
               for n, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]]
        for proc, per in sorted(totals.items())
    }
    return {"run_dir": str(run_dir), "steps": steps, "by_process": by_process}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a jax.profiler run directory (…/plugins/profile/<date_time>)")
    ap.add_argument("--top", type=int, default=25, help="events listed per process (default 25)")
    ap.add_argument("--out", type=Path, default=None, help="also write the summary as JSON here")
    args = ap.parse_args(argv)
    try:
        summary = summarize(args.run_dir, args.top)
    except FileNotFoundError as e:
        sys.exit(f"error: {e} (take the trace with create_perfetto_trace on, the default)")
    s = summary["steps"]
    print(f"engine steps: {s['count']}" + (f", p50 {s['p50_ms']} ms, p90 {s['p90_ms']} ms, max {s['max_ms']} ms"
                                           if s["count"] else ""))
    for proc, rows in summary["by_process"].items():
        print(f"\n{proc}")
        for r in rows:
            print(f"  {r['total_ms']:>12.3f} ms  {r['count']:>7d}  {r['name']}")
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
