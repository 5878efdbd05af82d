"""What the first structured-output request costs a running server: its own latency and the stall
every other stream sees, with the step variants compiled on first use and in the background.

A constrained step runs a variant of the step program (`serving/runner_variants.py`): compiled on
first use, it stops the engine thread for a whole step compile. For each mode the script starts
the real server (`python -m serving.run`, the embedded tiny checkpoint, the persistent compilation
cache off so both modes compile from scratch), waits for `/health` and, in `background` mode, for
the log line saying the variants are compiled; then it opens an unconstrained streamed completion
(`ignore_eos`, `--stream-tokens` tokens), and once that stream has produced 20 tokens sends
`--constrained` JSON-schema chat requests one after the other. Recorded: each constrained
request's latency, and the largest gap between two tokens of the unconstrained stream (the stall
the other users see) next to its median gap.

Modes: `first_use` (`--structured-outputs-config '{"precompile": false}'`) and `background` (the
server's default).

    PYTHONPATH=. .venv/bin/python scripts/bench_structured_first_use.py --out DIR   # ≈ 6 min on 2 cores

Writes `DIR/summary.json` and the servers' logs (`DIR/server_<mode>.log`), and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
MODES = {"first_use": '{"precompile": false}', "background": None}


def start_server(mode: str, port: int, log_path: Path, timeout: float) -> subprocess.Popen:
    argv = [sys.executable, "-m", "serving.run", "--port", str(port)]
    if MODES[mode] is not None:
        argv += ["--structured-outputs-config", MODES[mode]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLM53_COMPILATION_CACHE": "off"}
    env.pop("SKIP_JAX_PRECOMPILE", None)
    with open(log_path, "wb") as log:  # the server keeps its own descriptor
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the {mode} server exited during start-up; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"error: the {mode} server was not healthy after {timeout:.0f} s; see {log_path}")


def wait_for_log(log_path: Path, pattern: str, timeout: float) -> float | None:
    """Seconds until `pattern` appears in the log (None: it did not within `timeout`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if re.search(pattern, log_path.read_text(errors="replace")):
            return time.monotonic() - t0
        time.sleep(0.5)
    return None


def stream_gaps(base: str, tokens: int, started: threading.Event, out: dict) -> None:
    """An unconstrained streamed completion; `out["times"]`: the arrival time of each chunk."""
    times = []
    body = {"model": "glm-5.3-tiny", "prompt": "The river runs", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=600) as c, c.stream("POST", base + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
                if len(times) == 20:
                    started.set()
    out["times"] = times


def run_mode(mode: str, port: int, out_dir: Path, args) -> dict:
    log_path = out_dir / f"server_{mode}.log"
    t0 = time.monotonic()
    proc = start_server(mode, port, log_path, args.startup_timeout)
    healthy = time.monotonic() - t0
    base = f"http://127.0.0.1:{port}"
    try:
        background_s = None
        if mode == "background":
            background_s = wait_for_log(log_path, r"step variants compiled in the background", args.startup_timeout)
            if background_s is None:
                raise SystemExit(f"error: no background compile finished within {args.startup_timeout:.0f} s; "
                                 f"see {log_path}")
        started, gaps = threading.Event(), {}
        th = threading.Thread(target=stream_gaps, args=(base, args.stream_tokens, started, gaps))
        th.start()
        if not started.wait(300):
            raise SystemExit("error: the unconstrained stream produced no tokens")
        latencies, texts = [], []
        with httpx.Client(timeout=600) as c:
            for i in range(args.constrained):
                body = {"model": "glm-5.3-tiny", "max_tokens": 40, "temperature": 0,
                        "messages": [{"role": "user", "content": f"Plan trip {i}"}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}}
                t = time.monotonic()
                r = c.post(base + "/v1/chat/completions", json=body)
                latencies.append(time.monotonic() - t)
                r.raise_for_status()
                texts.append(r.json()["choices"][0]["message"]["content"])
        th.join()
        times = gaps["times"]
        d = [b - a for a, b in itertools.pairwise(times)]
        log = log_path.read_text(errors="replace")
        first_use = [float(x) for x in re.findall(r"compiled on first use in ([0-9.]+) s", log)]
        return {"mode": mode, "healthy_s": round(healthy, 1),
                "background_compile_done_after_health_s": None if background_s is None else round(background_s, 1),
                "constrained_latency_s": [round(x, 3) for x in latencies],
                "stream_tokens": len(times), "stream_max_gap_s": round(max(d), 3),
                "stream_median_gap_s": round(statistics.median(d), 4),
                "first_use_compiles_s": first_use, "constrained_outputs": texts}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for summary.json and the server logs")
    p.add_argument("--modes", default="first_use,background")
    p.add_argument("--port", type=int, default=8390)
    p.add_argument("--constrained", type=int, default=3, help="constrained requests, one after the other")
    p.add_argument("--stream-tokens", type=int, default=300)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: {', '.join(bad) or 'none given'}; choose from {', '.join(MODES)}")
    if args.constrained < 1 or args.stream_tokens < 40:
        p.error("--constrained must be >= 1 and --stream-tokens >= 40")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_mode(m, args.port + i, out, args) for i, m in enumerate(modes)]
    summary = {"args": vars(args), "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{'mode':>10} | {'healthy s':>9} | {'bg done +s':>10} | {'constrained latency s':>24} | "
          f"{'stream max gap s':>16} | {'median gap s':>12} | first-use compiles s")
    for r in rows:
        bg = r["background_compile_done_after_health_s"]
        print(f"{r['mode']:>10} | {r['healthy_s']:>9.1f} | {'–' if bg is None else f'{bg:.1f}':>10} | "
              f"{', '.join(f'{x:.2f}' for x in r['constrained_latency_s']):>24} | {r['stream_max_gap_s']:>16.3f} | "
              f"{r['stream_median_gap_s']:>12.4f} | {r['first_use_compiles_s']}")
    return summary


if __name__ == "__main__":
    main()
