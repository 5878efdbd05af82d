"""Multi-process engine benchmark: the leader → follower step channel's cost per step, and decode
throughput of one engine over 2 processes × 4 simulated devices against the same engine in one
process with 8 simulated devices, side by side in one run.

1. **Channel** (in this process, the follower end on a thread): real step inputs of the engine's
   shapes (`ModelRunner._dummy`: padding rows of the full `max_num_seqs + 1` request rows and
   block tables) at token buckets 1 and 32, each sent `--steps` times: the leader's cost (encode +
   send, what the engine's step waits for before dispatch), the follower's (receive + CRC32 +
   decode) and the one-way latency from the start of the send to the decoded inputs; median and
   p99 in µs, and the payload bytes.
2. **Decode**: `python -m serving.run` with `--data-parallel-size 2 --tensor-parallel-size 4
   --enable-expert-parallel` (one attention replica per process in the 2-process engine), then
   the same flags as a 2-process engine; B = 1 and 32 concurrent greedy requests (16-token
   prompts, `--max-tokens` output tokens, `ignore_eos`); tok/s = output tokens / wall seconds
   (prefill included), best of `--repeats`.

All processes share this machine's cores (2 on the development machine): the 2-process engine
runs two XLA:CPU runtimes and gloo collectives over loopback on them, so compare the rows of one
run only; on GPUs the step is device-bound and the channel cost is what remains.

    PYTHONPATH=. .venv/bin/python scripts/bench_multihost.py --out docs/results/multihost

Writes OUT/summary.json (the committed one: docs/results/multihost/) and OUT/server_*.log, and prints
the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sharding.distributed import free_port_pair

LAYOUT = ["--data-parallel-size", "2", "--tensor-parallel-size", "4", "--enable-expert-parallel"]
ENGINE = ["--max-model-len", "512", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
          "--cuda-graph-sizes", "1", "32", "--precompile-token-paddings", "--disable-log-stats",
          "--num-gpu-blocks-override", "160"]


def _pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs) * 1e6, q))


def bench_channel(steps: int) -> list[dict]:
    from serving.engine import EngineArgs
    from serving.engine_startup import load_engine_parts
    from serving.multihost import codec
    from serving.multihost.channel import FollowerChannel, LeaderChannel
    from serving.runner import ModelRunner
    from serving.step_inputs import StepInputs

    args = EngineArgs(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=512, cuda_graph_sizes=[1, 32],
                      precompile_token_paddings=[], compile_progress=False, disable_log_stats=True,
                      num_gpu_blocks_override=160)
    parts = load_engine_parts(args)
    runner = ModelRunner(parts.model, parts.layout, parts.num_blocks, max_num_seqs=32, max_num_batched_tokens=512,
                         max_model_len=512, cuda_graph_sizes=[1, 32], precompile_token_paddings=[])
    port = free_port_pair()
    leader = LeaderChannel(f"127.0.0.1:{port}", 1)
    follower = FollowerChannel(f"127.0.0.1:{port}", 1)
    follower.hello({})
    leader.wait_for_followers({}, 30)
    follower.await_start(30)
    rows = []
    for T in (1, 32):
        batch, extra = runner._dummy(T)
        inputs = StepInputs(batch, extra, None)
        sent, got, follower_s = [], [], []
        done = threading.Event()

        def receive(got=got, follower_s=follower_s, done=done):
            for _ in range(steps):
                _, body = follower.recv()
                t = time.perf_counter()
                codec.decode(body)
                got.append(time.perf_counter())
                follower_s.append(got[-1] - t)
            done.set()

        th = threading.Thread(target=receive)
        th.start()
        leader_s = []
        for _ in range(steps):
            t = time.perf_counter()
            sent.append(t)
            leader.send_step(codec.encode(inputs))
            leader_s.append(time.perf_counter() - t)
            time.sleep(0.002)  # one step at a time, as the engine sends them
        done.wait(60)
        th.join()
        one_way = [g - s for s, g in zip(sent, got)]
        rows.append({"tokens": T, "request_rows": 33, "payload_bytes": len(codec.encode(inputs)),
                     "leader_us_p50": _pct(leader_s, 50), "leader_us_p99": _pct(leader_s, 99),
                     "follower_decode_us_p50": _pct(follower_s, 50), "follower_decode_us_p99": _pct(follower_s, 99),
                     "one_way_us_p50": _pct(one_way, 50), "one_way_us_p99": _pct(one_way, 99)})
    leader.stop()
    follower.close()
    return rows


def _env(devices: int) -> dict:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip()}


def start(mode: str, out: Path) -> tuple[list[subprocess.Popen], str]:
    http = free_port_pair()
    py = [sys.executable, "-m", "serving.run"]
    if mode == "1-process":
        with open(out / "server_1process.log", "wb") as log:
            proc = subprocess.Popen(py + ["--port", str(http), *ENGINE, *LAYOUT], env=_env(8), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)
        return [proc], f"http://127.0.0.1:{http}"
    coord, master = free_port_pair(), free_port_pair()
    common = ["--coordinator-address", f"127.0.0.1:{coord}", "--master-port", str(master), "--num-processes", "2",
              *ENGINE, *LAYOUT]
    procs = []
    for pid in (1, 0):
        extra = ["--headless"] if pid else ["--port", str(http)]
        with open(out / f"server_2process_p{pid}.log", "wb") as log:
            procs.append(subprocess.Popen(py + ["--process-id", str(pid), *extra, *common], env=_env(4), cwd=REPO,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs, f"http://127.0.0.1:{http}"


def wait_healthy(url: str, procs, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server process exited during start-up: {[p.returncode for p in procs]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("not healthy in time")


def decode_rate(url: str, batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    prompts = [[(i * 37 + j * 11) % 400 + 4 for j in range(16)] for i in range(batch)]

    def one(p):
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": "glm-5.3-tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    t = time.perf_counter()
    with ThreadPoolExecutor(batch) as ex:
        outs = list(ex.map(one, prompts))
    wall = time.perf_counter() - t
    return sum(len(o) for o in outs) / wall, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/bench_multihost")
    ap.add_argument("--steps", type=int, default=300, help="channel messages per token bucket (default 300)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XLA_FLAGS", "")
    channel = bench_channel(a.steps)
    print("channel (µs per step):")
    for r in channel:
        print("  " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    decode, streams = [], {}
    for mode in ("1-process", "2-process"):
        procs, url = start(mode, out)
        try:
            wait_healthy(url, procs)
            decode_rate(url, 1, 4)  # warm-up
            for batch in (1, 32):
                best, toks = 0.0, None
                for _ in range(a.repeats):
                    rate, toks = decode_rate(url, batch, a.max_tokens)
                    best = max(best, rate)
                streams[(mode, batch)] = toks
                decode.append({"mode": mode, "batch": batch, "tok_s": best})
                print(f"  {mode} batch {batch}: {best:.1f} tok/s")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    for batch in (1, 32):
        row = next(r for r in decode if r["mode"] == "2-process" and r["batch"] == batch)
        base = next(r for r in decode if r["mode"] == "1-process" and r["batch"] == batch)
        row["ratio_to_1_process"] = row["tok_s"] / base["tok_s"]
        row["streams_identical"] = streams[("2-process", batch)] == streams[("1-process", batch)]
    summary = {"channel": channel, "decode": decode, "flags": ENGINE + LAYOUT, "max_tokens": a.max_tokens,
               "cpu_count": os.cpu_count()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(decode, indent=1))
    print(f"wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
