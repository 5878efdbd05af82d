"""Prefix-aware routing benchmark: two servers behind vllm-router under `round_robin`,
`cache_aware` and `kv_aware` (fed by our KV events, docs/kv_events.md; the router discovers the
servers' event sockets, or with mode `kv_aware_static` is given them as flags), and one
data-parallel server (`--data-parallel-size 2`) placing requests by its own prefix-aware replica
choice.

The agentic workload of `scripts/bench_agentic.py` (multi-turn conversations in the reference's
74,160 : 753 : 220 proportions, scaled down by `--scale`; each turn's prompt is the previous
prompt, its output and new user tokens, as token ids through /v1/completions; greedy,
`ignore_eos`), run at each concurrency c by c client threads over 2·c conversations. One
difference: a turn's prompt is the previous prompt and the new user tokens, without the previous
output, because vllm-router's `kv_aware` policy (0.1.17) skips its prefix matching for requests
carrying the `return_token_ids` key, even false (measured: the same request is credited 64 tokens
without the key, 0 with it), and without it the client does not know the output ids. Every mode
gets the same two replicas' worth of device pages (`--blocks` per server, or per DP replica), so
where a later turn lands decides whether its history is a prefix hit.

Columns: `prefix_hit_rate` (cached prompt tokens / prompt tokens, over all turns) and
`later_turn_hit_rate` (over turns after the first, where a hit is possible at all), TTFT p50/p90,
`logical_throughput_tok_s` ((prompt + output tokens) / wall), `requests`, `errors`, `wall_s`.
Each server process runs on its own simulated CPU device(s) and all share the machine's cores:
compare rows of one run only; the figures measure routing on a tiny model, not GPUs.

    PYTHONPATH=. .venv/bin/python scripts/bench_kv_routing.py --out /tmp/kvroute        # quick: scale 64, 4 turns, c = 4
    PYTHONPATH=. .venv/bin/python scripts/bench_kv_routing.py --scale 32 --turns 13 --concurrency 2,8 --out DIR

Writes OUT/summary.json, OUT/summary.csv, OUT/server_*.log, OUT/router_*.log and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.bench_agentic import (
    MODEL,
    Server,
    Workload,
    _free_port,
    run_point,
    summarize,
    wait_healthy,
)

COLUMNS = ["mode", "concurrency", "requests", "errors", "prefix_hit_rate", "later_turn_hit_rate", "ttft_p50_s",
           "ttft_p90_s", "logical_throughput_tok_s", "cached_tokens", "wall_s"]
# kv_aware: the router discovers each server's event sockets and block size (GET /kv_event_sources,
# /get_server_info); kv_aware_static: the same policy given them as flags.
ROUTER_MODES = ("round_robin", "cache_aware", "kv_aware", "kv_aware_static", "kv_aware_dp2", "kv_aware_dp2_merged")
# kv_aware_dp2 / kv_aware_dp2_merged: the two servers are data-parallel (--data-parallel-size 2,
# --blocks per replica: twice the pages of the other modes; compare these two with each other),
# publishing per rank (vLLM's way: the router credits rank 0 only) or one merged stream
# (`"merge_data_parallel": true`, docs/kv_events.md).


def _free_port_block(n: int = 2) -> int:
    """A port p with p … p + n − 1 free now (a data-parallel server's per-rank event sockets)."""
    import socket

    for _ in range(100):
        p = _free_port()
        try:
            socks = []
            for k in range(n):
                sk = socket.socket()
                socks.append(sk)
                sk.bind(("", p + k))
            return p
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError("no block of free ports")


class Router:
    """vllm-router with `policy` in front of `servers`; `metrics()` sums the servers' metrics.
    `event_ports` (url → port) become `--kv-event-source` flags (kv_aware_static; without them a
    kv_aware router discovers the sockets itself)."""

    def __init__(self, policy: str, servers: list[Server], log_path: Path, event_ports: dict[str, int] | None = None,
                 block_size: int = 64):
        exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        self.servers = servers
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [exe, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy, "--worker-urls",
               *[s.base for s in servers], "--request-timeout-secs", "3600", "--log-level", "debug"]
        for url, p in (event_ports or {}).items():
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{p}"]
        if event_ports:
            # The router indexes events per model: the name requests carry (the served model name).
            cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", MODEL]
        self.log = open(log_path, "w")
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OPENAI_API_KEY": ""})
        try:
            wait_healthy(self.proc, self.base, 60, log_path, "vllm-router")
        except RuntimeError:
            self.stop()
            raise
        time.sleep(1.0)  # the router's event subscribers connect

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.servers:
            for k, v in s.metrics().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", default="4")
    ap.add_argument("--blocks", type=int, default=64, help="device pages per server (per replica for dp2)")
    ap.add_argument("--modes", default="round_robin,cache_aware,kv_aware,dp2")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    wl = Workload.scaled(args.scale, args.turns)
    concs = [int(c) for c in args.concurrency.split(",")]
    max_len = 1 << (wl.final_context + 64).bit_length()
    from glm53.tiny_checkpoint import default_model_dir
    from glm53.tokenizer import tokenizer_vocab_size

    vocab = tokenizer_vocab_size(str(default_model_dir()))
    common = ["--max-model-len", str(max_len), "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
              "--enable-prefix-caching", "--disable-log-stats", "--num-gpu-blocks-override", str(args.blocks),
              "--cuda-graph-sizes", "8"]
    env_before = os.environ.get("XLA_FLAGS")
    rows = []
    try:
        for mode in args.modes.split(","):
            print(f"== {mode}: starting servers", flush=True)
            if mode == "dp2":
                os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
                target = Server(common + ["--data-parallel-size", "2", "--enable-expert-parallel"],
                                args.out / "server_dp2.log")
                stop = [target]
            elif mode in ROUTER_MODES:
                dp = mode.startswith("kv_aware_dp2")
                os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 if dp else 1}"
                kv = mode.startswith("kv_aware")
                ports = ([_free_port_block(), _free_port_block()] if dp else [_free_port(), _free_port()]) if kv \
                    else [None, None]
                servers = []
                try:
                    for i, p in enumerate(ports):
                        cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{p}"}
                        if dp:  # replica r publishes on p + r unless merged
                            cfg["merge_data_parallel"] = mode.endswith("merged")
                        ev = ["--kv-events-config", json.dumps(cfg)] if p else []
                        extra = ["--data-parallel-size", "2", "--enable-expert-parallel"] if dp else []
                        servers.append(Server(common + extra + ev, args.out / f"server_{mode}_{i}.log"))
                    target = Router("kv_aware" if kv else mode, servers, args.out / f"router_{mode}.log",
                                    {s.base: p for s, p in zip(servers, ports)} if mode == "kv_aware_static" else None)
                except Exception:
                    for s in servers:
                        s.stop()
                    raise
                stop = [target, *servers]
            else:
                raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join((*ROUTER_MODES, 'dp2'))}")
            try:
                for i, c in enumerate(concs):
                    results, samples, before, after, wall = run_point(target, wl, c, vocab, False, 1.0,
                                                                      conv_offset=1000 * i, return_token_ids=False)
                    row = summarize(mode, c, results, samples, before, after, wall, None, None)
                    ok = [r for r in results if r.error is None and r.t_first is not None]
                    prompt = sum(r.prompt_tokens for r in ok)
                    later = [r for r in ok if r.turn > 0]
                    later_prompt = sum(r.prompt_tokens for r in later)
                    row["prefix_hit_rate"] = round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None
                    row["later_turn_hit_rate"] = (round(sum(r.cached_tokens for r in later) / later_prompt, 4)
                                                  if later_prompt else None)
                    rows.append(row)
                    print("  " + ", ".join(f"{k}={row.get(k)}" for k in COLUMNS[1:]), flush=True)
            finally:
                for s in stop:
                    s.stop()
    finally:
        if env_before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = env_before
    (args.out / "summary.json").write_text(json.dumps({"workload": wl.__dict__, "blocks": args.blocks, "rows": rows},
                                                      indent=1))
    with open(args.out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"\nworkload {wl}, {args.blocks} pages per server; table in {args.out / 'summary.csv'}")
    print(" | ".join(COLUMNS))
    for r in rows:
        print(" | ".join(str(r.get(k)) for k in COLUMNS))
    return rows


if __name__ == "__main__":
    main()
