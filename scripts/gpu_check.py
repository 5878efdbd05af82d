"""One prepared check for a GPU session: everything the first H200 minutes should answer, in one
call that budgets its own time and writes one summary.

    PYTHONPATH=. python scripts/gpu_check.py --out DIR --budget-s 480      # on the GPU machine
    PYTHONPATH=. python scripts/gpu_check.py --out DIR --dry-run           # anywhere: every part, tiny

Parts, in priority order (each in its own process, so a crash or a hang in one cannot take the
others with it; each gets a share of what is left of `--budget-s` and is killed at it):

1. `env`         — jax / jaxlib versions, backend, devices and their kind, memory kinds, the
                   device's memory limit, `nvidia-smi` (driver, CUDA) when there is one.
2. `serve`       — the tiny model (or `--model`) end to end through the engine, each configuration twice: with
                   the Pallas kernels (`kernels/mode.py` "auto", which is "pallas" on a GPU;
                   "interpret" with `--dry-run`) and with the references ("reference"), greedy
                   streams compared under the equality rule (`glm53.equality.compare_streams`,
                   divergences listed, not raised): default (bf16 cache), FP8 cache, HiSparse on a
                   pool far too small with each host mechanism (`memory_kind`, `callback`), MTP
                   k = 2. Also tokens / s of each run, the compile seconds and the Pallas kernels
                   the kernel run's step program calls (`kernels.introspect`: a silent fallback to
                   a reference shows as a missing name), and a jax.profiler trace of the kernel
                   run's steps 2–9 summarised (`trace`: step times, each trace process's top
                   events — on a GPU its kernels; `scripts/trace_summary.py`; the Perfetto file
                   stays in `serve/trace_<config>/`). (The tiny model reaches
                   only sparse MLA and the HiSparse resolver on a GPU: docs/gpu_deployment.md.)
3. `kernels`     — `scripts/bench_kernels.py` (the Pallas kernels at GLM-5.3 shapes against their
                   HBM rooflines; `--smoke` with `--dry-run`).
4. `host_gather` — `scripts/probe_host_gather.py` (which host → device row mechanism is fastest;
                   `--smoke` with `--dry-run`).

Writes `DIR/summary.json` (per part: status "ok" / "failed" / "timeout" / "skipped", seconds,
its results, the tail of its log) and prints a table; each part's own files are under
`DIR/<part>/`. `--dry-run` makes no timing claims: it proves the script and every part run (the
suite runs it: tests/scripts/test_gpu_check.py), so the first GPU call cannot die on a typo.
docs/gpu_deployment.md says what each number means.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("env", "serve", "kernels", "host_gather")
# Shares of the budget left when a part starts (the last part takes whatever is left).
SHARES = {"env": 0.05, "serve": 0.45, "kernels": 0.6, "host_gather": 1.0}


# ---------------------------------------------------------------------------------------- parts
def part_env(out: str, dry_run: bool, budget_s: float) -> dict:
    import jax

    dev = jax.devices()[0]
    info = {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
            "python": sys.version.split()[0], "backend": jax.default_backend(), "device_count": jax.device_count(),
            "device_kind": dev.device_kind, "platform": dev.platform,
            "memory_kinds": sorted(m.kind for m in dev.addressable_memories()),
            "bytes_limit": (dev.memory_stats() or {}).get("bytes_limit")}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout.splitlines()
        info["cuda_line"] = next((line.strip() for line in head if "CUDA Version" in line), None)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"not available ({type(e).__name__})"
    return info


SERVE_CONFIGS = {
    # name: EngineArgs overrides (on top of the small engine of `part_serve`) and the prompts' kind
    "default": ({}, "short"),
    "fp8_cache": ({"kv_cache_dtype": "fp8"}, "short"),
    "hisparse_memory_kind": ({"num_gpu_blocks_override": 10, "max_model_len": 512, "attention_config": {
        "hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 1024, "host_gather": "memory_kind"}}},
        "long"),
    "hisparse_callback": ({"num_gpu_blocks_override": 10, "max_model_len": 512, "attention_config": {
        "hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 1024, "host_gather": "callback"}}},
        "long"),
    "mtp": ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}, "short"),
}


def _prompts(kind: str, dry_run: bool) -> dict:
    if kind == "long":  # two 400-token contexts on a 9-page pool: HiSparse must serve them from the host
        return {"a": [(7 * i) % 300 + 4 for i in range(400)], "b": [(13 * i) % 400 + 4 for i in range(400)]}
    n = 2 if dry_run else 4
    return {chr(97 + r): [(7 * i + 3 * r) % 300 + 4 for i in range(40 + 30 * r)] for r in range(n)}


TRACE_STEPS = 8  # engine steps a kernel run traces, after its first (which compiles)


def _traced_steps(e, streams: dict, lps: dict, trace_dir: str | None, trace_steps: int = TRACE_STEPS
                  ) -> tuple[int, dict | None]:
    """Step `e` to the end, collecting outputs → (steps, trace summary or None). With `trace_dir`,
    steps 2 … trace_steps + 1 run under a jax.profiler trace (the Python tracer off), summarised
    by scripts/trace_summary.py (the raw XSpace file removed, the Perfetto file kept); a failing
    trace is reported in the summary, not raised, and a step that raises mid-trace ends it."""
    import jax

    steps, trace, tracing = 0, None, False
    try:
        while e.has_unfinished_requests():
            if trace_dir is not None and steps == 1:
                try:
                    options = jax.profiler.ProfileOptions()
                    options.python_tracer_level = 0
                    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
                    tracing = True
                except Exception as err:  # noqa: BLE001 - a trace is a bonus, not the check
                    trace = {"error": f"{type(err).__name__}: {err}"}
            with jax.profiler.StepTraceAnnotation("engine_step", step_num=steps):
                outs = e.step()
            for o in outs:
                streams[o.request_id] += o.new_token_ids
                lps[o.request_id] += o.new_logprobs or []
            steps += 1
            if tracing and (steps > trace_steps or not e.has_unfinished_requests()):
                tracing = False
                trace = _stop_trace(trace_dir)
    finally:
        if tracing:  # a step raised mid-trace: end it, so the next run can trace
            _stop_trace(trace_dir)
    return steps, trace


def _stop_trace(trace_dir: str) -> dict:
    """End the trace and summarise its run (the XSpace file removed) → the summary, or {"error"}."""
    import glob

    import jax

    from scripts.trace_summary import summarize
    from serving.profiling import latest_run

    try:
        jax.profiler.stop_trace()
        run = latest_run(trace_dir)
        summary = summarize(run, top=15)
        for f in glob.glob(os.path.join(run, "*.xplane.pb")):
            os.remove(f)
        return summary
    except Exception as err:  # noqa: BLE001 - a trace is a bonus, not the check
        return {"error": f"{type(err).__name__}: {err}"}


def _serve_once(mode: str, overrides: dict, prompts: dict, max_tokens: int, model: str | None = None,
                trace_dir: str | None = None) -> dict:
    from kernels.mode import use_kernels
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.types import SamplingParams

    args = dict(model=model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, cuda_graph_sizes=[4],
                precompile_token_paddings=[], compile_progress=False, disable_log_stats=True)
    t0 = time.perf_counter()
    with use_kernels(mode):
        e = build_engine(EngineArgs(**{**args, **overrides}))
    compile_s = time.perf_counter() - t0
    for rid, p in prompts.items():
        e.add_request(rid, p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
    streams, lps = {r: [] for r in prompts}, {r: [] for r in prompts}
    t0 = time.perf_counter()
    steps, trace = _traced_steps(e, streams, lps, trace_dir)
    run_s = time.perf_counter() - t0
    out = {"mode": mode, "compile_s": round(compile_s, 2), "run_s": round(run_s, 3), "steps": steps,
           "tokens_per_s": round(sum(map(len, streams.values())) / run_s, 1) if run_s else None,
           "audit": e.audit()}
    if trace is not None:  # (run_s includes the traced steps' profiler cost)
        out["trace"] = trace
    if mode != "reference":  # the Pallas kernels the step program calls (a silent fallback shows here)
        from kernels.introspect import pallas_kernels

        out["pallas_kernels"] = sorted(pallas_kernels(e.runner.trace_step(hot=e.hisparse is not None)))
    if e.hisparse is not None:
        out.update(hot_steps=e.runner.num_hot_steps, misses=e.hisparse.device.misses,
                   h2d_bytes=e.hisparse.device.h2d_bytes, mechanism=e.hisparse.device.mechanism)
    if e.spec_stats is not None and getattr(e.spec_stats, "num_draft_tokens", 0):
        out.update(draft_tokens=e.spec_stats.num_draft_tokens, accepted_tokens=e.spec_stats.num_accepted_tokens)
    return {"summary": out, "streams": streams, "logprobs": lps}


def part_serve(out: str, dry_run: bool, budget_s: float, configs=None, model: str | None = None) -> dict:
    """Each configuration of `configs` (default: all of SERVE_CONFIGS) served twice, kernels and
    references, on `model` (a checkpoint directory; None: the embedded tiny checkpoint). Returns
    {name: result}, also written to `out`/result.json after each configuration."""
    from glm53 import api
    from glm53.equality import compare_streams

    start = time.perf_counter()
    kernels_mode = "interpret" if dry_run else "auto"
    max_tokens = 3 if dry_run else 32
    results = {}
    last_s = 0.0
    for name in configs or SERVE_CONFIGS:
        overrides, kind = SERVE_CONFIGS[name]
        if dry_run:
            overrides = {**overrides, "cuda_graph_sizes": []}  # one step program per engine
        left = budget_s - (time.perf_counter() - start)
        if left < max(20.0, 1.3 * last_s):  # the last configuration's time predicts this one's
            results[name] = {"status": "skipped", "reason": f"{left:.0f} s of the part's budget left"}
            continue
        t0 = time.perf_counter()
        prompts = _prompts(kind, dry_run)
        try:
            ref = _serve_once("reference", overrides, prompts, max_tokens, model)
            # (no trace in a dry run: interpret-mode kernels make a CPU trace slow to write, seconds a
            # step; tests/scripts/test_gpu_check.py checks the tracing on a stand-in engine)
            got = _serve_once(kernels_mode, overrides, prompts, max_tokens, model,
                              trace_dir=None if dry_run else os.path.join(out, f"trace_{name}"))
            lm = api.load(model, cache_dtype=overrides.get("kv_cache_dtype", "bfloat16"))
            divs = compare_streams(ref["streams"], got["streams"], ref["logprobs"], prompts, lm, strict=False,
                                   verbose=False)
            results[name] = {"status": "ok", "reference": ref["summary"], "kernels": got["summary"],
                             "streams_equal": ref["streams"] == got["streams"],
                             "divergences": [str(d) for d in divs]}
        except Exception as e:  # noqa: BLE001 - one configuration's failure is a result, not the end
            results[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
        last_s = time.perf_counter() - t0
        results[name]["seconds"] = round(last_s, 1)
        with open(os.path.join(out, "result.json"), "w") as f:  # so far (a part killed at its budget keeps it)
            json.dump(results, f, indent=1, default=str)
        print(f"serve {name}: {results[name].get('status')}"
              f"{'' if 'streams_equal' not in results[name] else ', streams equal' if results[name]['streams_equal'] else ', streams differ'}",
              flush=True)
    return results


def _script_part(script: str, out: str, dry_run: bool, budget_s: float) -> dict:
    """Run a benchmark script (its own `--budget-s`, a little under the part's) → its JSON."""
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, os.path.join(REPO, "scripts", script), "--out", out, "--budget-s", str(max(5.0, 0.85 * budget_s))]
    if dry_run:
        cmd.append("--smoke")
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    name = os.path.splitext(script)[0]
    with open(os.path.join(out, f"{name}.json")) as f:
        data = json.load(f)
    return {"file": os.path.join(out, f"{name}.json"), "keys": sorted(data)[:20]}


def part_kernels(out: str, dry_run: bool, budget_s: float) -> dict:
    return _script_part("bench_kernels.py", out, dry_run, budget_s)


def part_host_gather(out: str, dry_run: bool, budget_s: float) -> dict:
    return _script_part("probe_host_gather.py", out, dry_run, budget_s)


PART_FUNCS = {"env": part_env, "serve": part_serve, "kernels": part_kernels, "host_gather": part_host_gather}


# ---------------------------------------------------------------------------------------- driver
def run_part(part: str, out: str, dry_run: bool, budget_s: float, serve_configs: list[str],
             model: str | None = None) -> dict:
    """Run one part in a child process killed at `budget_s` → its summary entry."""
    part_dir = os.path.join(out, part)
    os.makedirs(part_dir, exist_ok=True)
    log_path = os.path.join(part_dir, "log.txt")
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--out", part_dir, "--budget-s", f"{budget_s:.1f}"]
    if dry_run:
        cmd.append("--dry-run")
    if part == "serve":
        cmd += ["--serve-configs", ",".join(serve_configs)]
        if model:
            cmd += ["--model", model]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=log,
                                stderr=subprocess.STDOUT, timeout=budget_s).returncode
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
    entry = {"status": status, "seconds": round(time.perf_counter() - t0, 1), "budget_s": round(budget_s, 1),
             "log": log_path}
    result = os.path.join(part_dir, "result.json")
    if os.path.exists(result):
        with open(result) as f:
            entry["result"] = json.load(f)
    with open(log_path) as f:
        entry["log_tail"] = f.read()[-1500:]
    return entry


def print_table(summary: dict) -> None:
    print(f"\n{'part':<12} {'status':<8} {'seconds':>8}  notes")
    for part, e in summary["parts"].items():
        note = ""
        if part == "env" and "result" in e:
            r = e["result"]
            note = f"jax {r['jax']}, {r['backend']}, {r['device_count']} x {r['device_kind']}"
        elif part == "serve" and "result" in e:
            note = "; ".join(f"{k}: {v['status']}" + (", equal" if v.get("streams_equal") else
                                                        f", {len(v.get('divergences', []))} divergence(s)"
                                                        if v["status"] == "ok" else "")
                             for k, v in e["result"].items())
        elif "result" in e:
            note = e["result"].get("file", "")
        print(f"{part:<12} {e['status']:<8} {e.get('seconds', 0):>8}  {note}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for summary.json and each part's files")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall seconds for the whole check (default 480)")
    ap.add_argument("--dry-run", action="store_true", help="every part at tiny sizes, interpret-mode kernels")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--serve-configs", default=",".join(SERVE_CONFIGS),
                    help=f"the serve part's configurations, in order (default: all of {', '.join(SERVE_CONFIGS)})")
    ap.add_argument("--model", default=None,
                    help="the serve part's checkpoint directory, local (default: the embedded tiny checkpoint; the "
                         "configurations' pool sizes are the tiny model's, so give a model of that scale)")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # internal: run one part in this process
    a = ap.parse_args(argv)
    if not a.budget_s > 0:  # (also NaN)
        ap.error(f"--budget-s must be a positive number of seconds, got {a.budget_s}")
    os.makedirs(a.out, exist_ok=True)
    configs = [c.strip() for c in a.serve_configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in SERVE_CONFIGS]
    if bad:
        ap.error(f"--serve-configs: unknown {bad}; choose from {', '.join(SERVE_CONFIGS)}")
    if a.model is not None and not os.path.isfile(os.path.join(a.model, "config.json")):
        ap.error(f"--model: {a.model!r} is not a checkpoint directory (no config.json in it)")
    if a.model is not None:
        a.model = os.path.abspath(a.model)  # the parts run with the repository as their directory
    if a.part:  # child: run the part, write result.json
        if a.part == "serve":
            result = part_serve(a.out, a.dry_run, a.budget_s, configs, a.model)
        else:
            result = PART_FUNCS[a.part](a.out, a.dry_run, a.budget_s)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        return 0
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    start = time.perf_counter()
    summary = {"argv": sys.argv[1:] if argv is None else list(argv), "dry_run": a.dry_run, "budget_s": a.budget_s,
               "model": a.model or "the embedded tiny checkpoint",
               "parts": {}}
    for part in PARTS:
        if part not in parts:
            continue
        left = a.budget_s - (time.perf_counter() - start)
        if left < 5:
            summary["parts"][part] = {"status": "skipped", "reason": f"{left:.0f} s of the budget left"}
            continue
        # (every part gets at least 30 s, or all that is left: starting a process that imports jax
        # takes seconds)
        share = left if part == parts[-1] else min(left, max(30.0, left * SHARES[part]))
        print(f"== {part}: up to {share:.0f} s", flush=True)
        summary["parts"][part] = run_part(part, a.out, a.dry_run, share, configs, a.model)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print_table(summary)
    print(f"\nwrote {os.path.join(a.out, 'summary.json')} ({summary['seconds']} s)")
    return 0 if all(e["status"] in ("ok", "skipped") for e in summary["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
