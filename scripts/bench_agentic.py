"""Agentic multi-turn benchmark: Hybrid HiSparse vs preemption vs an ample pool (docs/design.md §9).

The reference workload (the source documents' OpenHands sweep) scaled down by `--scale`: 13-turn
conversations whose first turn, later turns and outputs keep the 74,160 : 753 : 220 proportions
(`--scale 16`: 4,635 / 47 / 14 tokens), deterministic content (seeded token ids of the tiny
checkpoint's vocabulary), `ignore_eos`, greedy. Each turn's prompt is the previous turn's prompt,
its output and the new user tokens (token ids through /v1/completions with vLLM's
`return_token_ids`), so every later turn is a prefix-cache hit on the whole history.

One server per mode (`python -m serving.run` in a subprocess, `--enable-prefix-caching`):

* `ample`: a device pool that holds every conversation of the top concurrency (the reference
  streams, with top-2 logprobs for the equality rule);
* `preemption`: the baseline, a pool that holds `--baseline-contexts` full final contexts
  (`--num-gpu-blocks-override`), preemption by recompute when it runs out;
* `offload`: the same pool with the CPU KV offloading connector (`--kv-transfer-config`,
  `cpu_bytes_to_use` = the whole host budget): prefixes the device cache loses come back from host
  memory, but a request still runs only with all its pages on the device;
* `hisparse`: the same pool with `--attention-config '{"hisparse_config": ...}'` plus the connector
  for the groups HiSparse does not manage (the indexer keys), the host budget split 3 : 1 between
  the HiSparse pool and the connector as in the reference deployment (384 + 128 GiB vs 512 GiB).

For each concurrency c of the sweep, 2·c conversations are run by c client threads (a thread
takes the next conversation and runs its turns one after the other), while a scraper reads
`/metrics` every `--scrape-s` seconds. Per (mode, c) point:

* `mean_running`: the non-zero mean of the scraped `vllm:num_requests_running` samples (the
  source's request occupancy); `predicted_running`: the capacity planner's steady-state count for
  the final context (`glm53.capacity`, engine units: device-resident, or
  `predict_hisparse_requests` with the engine's reserve), capped by c and --max-num-seqs;
  `mean_running_while_waiting`: the mean of the running samples taken while
  `vllm:num_requests_waiting` was above 0 (the engine had more work than it ran: the client gaps
  and the ramp at the start and end of a point do not count), and `share_waiting` the share of
  samples with a waiting request;
* `logical_throughput_tok_s`: (prompt tokens incl. cached ones + output tokens) / wall time, per
  device (one here);
* `interactivity`: 1000 / mean TPOT (ms) over requests (the single-node write-up's definition);
  `agentx_tok_s_per_user`: 1 / P90 over requests of (end-to-end latency / output tokens)
  (SemiAnalysis AgentX, TTFT included);
* `ttft_p50_s`, `ttft_p90_s`; `preemptions` (Δ `vllm:num_preemptions_total`); `hot_hit_rate`
  and `h2d_bytes` (Δ of the HiSparse counters); `cached_tokens`; `host_tier_hit_rate` (Δ
  `vllm:external_prefix_cache_hits` / Δ `..._queries`: prompt tokens that came back from the
  connector's host store), `offload_to_host_bytes` / `offload_to_device_bytes` (Δ
  `vllm:kv_offload_total_bytes` by transfer type);
* `equal_under_rule`: every stream of the mode equals the ample run's (same conversation and
  turn) under docs/design.md §10's equality rule (`glm53.equality`: divergences only at a top-2 logit
  gap < 1e-4 or an indexer top-k boundary gap < 1e-3, counted in `divergences`, each listed in
  `divergence_details` with its gaps). Once a turn diverged (explained), the conversation's later
  prompts differ from the reference's: those turns are not compared (`turns_after_a_divergence`).
  `greedy_identical` is the strict claim: equal under the rule with no divergence at all and no
  turn left uncompared. `equality` says which in words ("strict: every turn identical", "under
  the rule: N accepted divergence(s), M turn(s) not compared", or what failed). Results files
  written before these fields existed used `greedy_identical` for `equal_under_rule`.

Writes `OUT/summary.json` (a list of rows with the keys above plus `mode`, `concurrency`),
`OUT/samples_<mode>_c<c>.json` (the scraped (running, waiting) pairs of each run of a point),
`OUT/summary.csv`, `OUT/agentic.png` (interactivity vs logical throughput; running requests vs
concurrency, with the planner's predictions), `OUT/server_<mode>.log`, and prints a table.

    PYTHONPATH=. .venv/bin/python scripts/bench_agentic.py --quick --out /tmp/agentic
    PYTHONPATH=. .venv/bin/python scripts/bench_agentic.py --scale 16 --concurrency 1,8,16,24,32 --out DIR

`--quick` (under 15 minutes on 2 CPU cores): `--scale 32 --concurrency 1,4,10 --turns 13`. The
prefill chunk (`--max-num-batched-tokens`) scales with the turns: 32,768 / scale (the reference
deployment's 32,768 at scale 1), so a first turn takes three chunks at every scale.
Numbers on a CPU measure the serving machinery on a tiny model, not an H200's speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import csv
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

REF_FIRST, REF_LATER, REF_OUT = 74_160, 753, 220
MODES = ("ample", "preemption", "offload", "hisparse")
MODEL = "bench-agentic"


# ----------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """Token counts of one conversation: `first` prompt tokens, then `later` new user tokens per
    later turn, `out` output tokens per turn, `turns` turns."""

    first: int
    later: int
    out: int
    turns: int

    @classmethod
    def scaled(cls, scale: float, turns: int = 13) -> "Workload":
        return cls(max(1, round(REF_FIRST / scale)), max(1, round(REF_LATER / scale)),
                   max(2, round(REF_OUT / scale)), turns)

    @property
    def final_context(self) -> int:
        """Tokens of the last turn's prompt plus its output."""
        return self.first + (self.turns - 1) * (self.later + self.out) + self.out


def user_tokens(conv: int, turn: int, n: int, vocab: int) -> list[int]:
    """Deterministic token ids of conversation `conv`, turn `turn` (ordinary ids, no specials)."""
    rng = np.random.default_rng([conv, turn, 7])
    return rng.integers(10, vocab, n).tolist()


# ----------------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, log_path: Path, what: str) -> float:
    """Wait until `base`/health answers 200; → seconds waited. Raises RuntimeError when `proc`
    exits first or `timeout_s` passes (naming `log_path`)."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{what} not healthy after {timeout_s} s; see {log_path}")
        time.sleep(0.5)


class Server:
    """`python -m serving.run` in a subprocess on a free loopback port. With `num_processes` > 1,
    one engine over that many processes (serving/multihost): this process's leader serves HTTP and
    the followers run `--headless`, each with `devices_per_process` simulated CPU devices (their
    logs: `log_path` with `.follower<i>` appended)."""

    def __init__(self, flags: list[str], log_path: Path, timeout_s: float = 900, num_processes: int = 1,
                 devices_per_process: int | None = None):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if any(f.endswith("-parallel-size") for f in flags) and "XLA_FLAGS" not in os.environ:
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # a parallel layout on the CPU
        if devices_per_process is not None:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
        self.followers: list[subprocess.Popen] = []
        self._follower_logs = []
        if num_processes > 1:
            from sharding.distributed import loopback_engine_flags

            flags = [*loopback_engine_flags(num_processes), *flags]
            for pid in range(1, num_processes):
                log = open(f"{log_path}.follower{pid}", "w")
                self._follower_logs.append(log)
                self.followers.append(subprocess.Popen(
                    [sys.executable, "-m", "serving.run", "--headless", "--process-id", str(pid), "--log-level",
                     "warning", *flags], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
            flags = ["--process-id", "0", *flags]
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "serving.run", "--port", str(self.port), "--served-model-name", MODEL,
               "--log-level", "warning", *flags]
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.startup_s = wait_healthy(self.proc, self.base, timeout_s, log_path, "server")
        except RuntimeError:
            self.stop()
            raise

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics summed over labels except `state` and `transfer_type` (kept apart as
        `name{value}`)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        text = httpx.get(self.base + "/metrics", timeout=30).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                lab = s.labels.get("state") or s.labels.get("transfer_type")
                key = s.name + (f"{{{lab}}}" if lab else "")
                out[key] = out.get(key, 0.0) + s.value
        return out

    def stop(self) -> None:
        """SIGTERM (the leader stops its followers), then kill what is left after 30 s."""
        for p in [self.proc, *self.followers]:
            if p.poll() is None:
                if p is self.proc:
                    p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        for f in [self.log, *self._follower_logs]:
            f.close()


# ----------------------------------------------------------------------------------- clients
@dataclass
class TurnResult:
    conv: int
    turn: int
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    top2_gaps: list[float] = field(default_factory=list)
    t_send: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_send

    @property
    def tpot(self) -> float | None:
        return (self.t_last - self.t_first) / (len(self.output) - 1) if len(self.output) > 1 else None

    @property
    def e2e_per_token(self) -> float:
        return (self.t_last - self.t_send) / max(1, len(self.output))


def run_turn(client: httpx.Client, base: str, res: TurnResult, out_tokens: int, logprobs: bool,
             return_token_ids: bool = True) -> None:
    """One streamed turn. Without `return_token_ids` (vllm-router's kv_aware policy skips its
    prefix matching for a request that carries the key at all, even false) the output ids are
    unknown: `res.output` holds one -1 per output token (from the usage), for counting only."""
    body = {"model": MODEL, "prompt": res.prompt, "max_tokens": out_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if return_token_ids:  # (the key alone, even false, turns vllm-router's kv_aware matching off)
        body["return_token_ids"] = True
    if logprobs:
        body["logprobs"] = 2
    res.t_send = time.monotonic()
    with client.stream("POST", base + "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
            return
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                ids = ch.get("token_ids") or ([] if return_token_ids or not ch.get("text") else [-1])
                if ids:
                    now = time.monotonic()
                    res.t_first = res.t_first or now
                    res.t_last = now
                    res.output.extend(ids)
                lp = ch.get("logprobs")
                if lp and lp.get("top_logprobs"):
                    for alts in lp["top_logprobs"]:
                        vals = sorted((alts or {}).values(), reverse=True)
                        res.top2_gaps.append(vals[0] - vals[1] if len(vals) >= 2 else float("inf"))
            if chunk.get("usage"):
                u = chunk["usage"]
                if not return_token_ids:
                    res.output = [-1] * u["completion_tokens"]
                res.prompt_tokens = u["prompt_tokens"]
                res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def run_point(server: Server, wl: Workload, concurrency: int, vocab: int, logprobs: bool, scrape_s: float,
              conv_offset: int, return_token_ids: bool = True) -> tuple[list[TurnResult], list[float], dict, dict, float]:
    """2·c conversations over c client threads. Returns (turn results, (running, waiting) samples, metrics
    before, metrics after, wall seconds). Without `return_token_ids` a turn's prompt is the
    previous prompt and the new user tokens (the output ids are not known)."""
    convs = list(range(conv_offset, conv_offset + 2 * concurrency))
    lock = threading.Lock()
    results: list[TurnResult] = []
    samples: list[tuple[float, float]] = []  # (running, waiting) per scrape
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            try:
                m = server.metrics()
                samples.append((m.get("vllm:num_requests_running", 0.0), m.get("vllm:num_requests_waiting", 0.0)))
            except httpx.HTTPError:
                pass
            stop.wait(scrape_s)

    def worker():
        with httpx.Client() as client:
            while True:
                with lock:
                    if not convs:
                        return
                    c = convs.pop(0)
                prompt = user_tokens(c, 0, wl.first, vocab)
                for t in range(wl.turns):
                    res = TurnResult(c, t, list(prompt))
                    run_turn(client, server.base, res, wl.out, logprobs, return_token_ids)
                    with lock:
                        results.append(res)
                    if res.error:
                        return
                    prompt = prompt + (res.output if return_token_ids else []) + user_tokens(c, t + 1, wl.later, vocab)

    before = server.metrics()
    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    stop.set()
    scraper.join()
    return results, samples, before, server.metrics(), wall


# ----------------------------------------------------------------------------------- sizing
LAYOUTS = {  # --layout → the server's parallel flags (8 simulated CPU devices when > 1)
    "1": [],
    "tp2": ["--tensor-parallel-size", "2"],
    "tp2xdcp2": ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"],
    "dp2": ["--data-parallel-size", "2", "--enable-expert-parallel"],
}


def layout_sizes(name: str) -> tuple[int, int]:
    """(dcp, dp) of a --layout."""
    flags = LAYOUTS[name]
    get = lambda f: int(flags[flags.index(f) + 1]) if f in flags else 1  # noqa: E731
    return get("--decode-context-parallel-size"), get("--data-parallel-size")


@dataclasses.dataclass(frozen=True)
class _EnginePages:
    name: str
    tokens_per_page: int


def pool_sizes(wl: Workload, baseline_contexts: int, top_conc: int, cache_dtype: str, dcp: int = 1):
    """(model config, KV layout, pages per final context, small pool, ample pool) in engine pages
    (incl. the null block; under DCP an engine page spans tokens_per_page × dcp tokens, the pools
    are per arena shard)."""
    from glm53.capacity import pages_per_request
    from glm53.config import GlmConfig
    from glm53.kv_layout import build_kv_layout
    from glm53.tiny_checkpoint import default_model_dir

    cfg = GlmConfig.from_pretrained(str(default_model_dir()))
    layout = build_kv_layout(cfg, cache_dtype, with_mtp=False)
    per = sum(pages_per_request([_EnginePages(g.name, g.tokens_per_page * dcp) for g in layout.groups],
                                wl.final_context).values())
    return cfg, layout, per, baseline_contexts * per + 1, 2 * top_conc * per + 8


def chunk_tokens(scale: float) -> int:
    """The prefill chunk (--max-num-batched-tokens) at `scale`: the reference's 32,768, scaled."""
    return max(64, round(32_768 / scale))


def offload_connector(nbytes: int) -> dict:
    """--kv-transfer-config of the CPU offloading connector with `nbytes` of host memory."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": int(nbytes)}}


def host_budget(wl: Workload, top_conc: int, cfg, mla, extra: dict, budget: int, dcp: int = 1) -> dict:
    """The run's host memory and HiSparse sizing: `hs` (hisparse_config: a pool of 2·c + 4 final
    contexts plus the `extra` keys), `host_total` (bytes; HiSparse's pool is 3/4 of it and its
    connector 1/4, the reference's 384 + 128 GiB; the offload mode's connector gets all of it, the
    reference baseline's 512 GiB), `host_blocks` (the pool in MLA pages per DCP rank) and
    `planner` (the hot-row inputs of `predicted`)."""
    host_bytes = (2 * top_conc + 4) * wl.final_context * mla.bytes_per_token
    hs = {"host_pool_gib": round(host_bytes / 2**30, 4) + 0.001, **extra}
    rows = hs.get("device_buffer_size", 2 * cfg.index_topk)
    return {"hs": hs, "host_total": int(hs["host_pool_gib"] * 2**30 * 4 / 3),
            "host_blocks": math.ceil(hs["host_pool_gib"] * 2**30 / (mla.bytes_per_token * mla.tokens_per_page * dcp)),
            "planner": {"device_buffer_rows": rows, "max_num_batched_tokens": budget,
                        "prefill_rows": hs.get("prefill_buffer_size", max(rows, 16 * cfg.index_topk))}}


def predicted(mode: str, layout, nblocks: int, wl: Workload, hs: dict, conc: int, max_num_seqs: int,
              host_blocks: int, dcp: int = 1, dp: int = 1) -> int:
    """The planner's steady-state running requests for the final context, capped by c (engine
    pages under DCP with per-rank hot rows; `dp` replicas of `max_num_seqs` each)."""
    from glm53.capacity import predict_device_resident_requests, predict_hisparse_requests

    L = wl.final_context
    groups = [_EnginePages(g.name, g.tokens_per_page * dcp) for g in layout.groups]
    if mode == "hisparse":
        g = layout.group("mla")
        dec = math.ceil(hs["device_buffer_rows"] / g.tokens_per_page) * g.tokens_per_page
        n = predict_hisparse_requests(groups, nblocks, L, dec, host_blocks=host_blocks, reserve_per_request=1,
                                      window_tokens=2 * hs["max_num_batched_tokens"],
                                      prefill_hot_rows=hs["prefill_rows"],
                                      hot_tokens_per_page=g.tokens_per_page).requests
    else:
        n = predict_device_resident_requests(groups, nblocks, L)
    return min(n * dp, conc, max_num_seqs * dp)


# ----------------------------------------------------------------------------------- report
def percentile(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(mode, conc, results, samples, before, after, wall, pred, ref, lm=None) -> dict:
    from glm53.equality import compare_streams

    ok = [r for r in results if r.error is None and r.t_first is not None]
    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
    tpots = [r.tpot for r in ok if r.tpot is not None]
    nz = [r for r, _ in samples if r > 0]
    busy = [r for r, w in samples if w > 0]  # the engine had more work than it ran
    hits, misses = d("vllm:hisparse_cache_hits_total"), d("vllm:hisparse_cache_misses_total")
    tokens = sum(r.prompt_tokens + len(r.output) for r in ok)
    row = {
        "mode": mode, "concurrency": conc, "requests": len(ok), "errors": len(results) - len(ok),
        "mean_running": round(statistics.mean(nz), 3) if nz else 0.0, "predicted_running": pred,
        "mean_running_while_waiting": round(statistics.mean(busy), 3) if busy else None,
        "share_waiting": round(len(busy) / len(samples), 3) if samples else None,
        "logical_throughput_tok_s": round(tokens / wall, 2),
        "interactivity": round(1.0 / statistics.mean(tpots), 3) if tpots else None,  # = 1000 / TPOT ms
        "agentx_tok_s_per_user": round(1.0 / percentile([r.e2e_per_token for r in ok], 90), 3) if ok else None,
        "ttft_p50_s": round(percentile([r.ttft for r in ok], 50), 4),
        "ttft_p90_s": round(percentile([r.ttft for r in ok], 90), 4),
        "preemptions": int(d("vllm:num_preemptions_total")),
        "hot_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "h2d_bytes": int(d("vllm:hisparse_host_to_device_bytes_total")),
        "cached_tokens": sum(r.cached_tokens for r in ok), "wall_s": round(wall, 2),
    }
    ext_q = d("vllm:external_prefix_cache_queries_total")
    row["host_tier_hit_rate"] = round(d("vllm:external_prefix_cache_hits_total") / ext_q, 4) if ext_q else None
    row["offload_to_host_bytes"] = int(d("vllm:kv_offload_total_bytes_total{gpu_to_cpu}"))
    row["offload_to_device_bytes"] = int(d("vllm:kv_offload_total_bytes_total{cpu_to_gpu}"))
    if ref is not None and not ref:  # the ample mode did not run: nothing to compare with
        row.update(equal_under_rule=None, greedy_identical=None, divergences=None, turns_after_a_divergence=None,
                   equality="not compared (no ample run in this invocation)")
    elif ref is not None:
        key = lambda r: (r.conv, r.turn)  # noqa: E731
        # A turn whose prompt is not the reference's (an earlier turn of its conversation took
        # another, explained, path) has no reference to be compared with: counted apart.
        ref_prompt = {key(r): r.prompt for r in ref}
        same = {key(r) for r in ok if ref_prompt.get(key(r)) == r.prompt}
        row["turns_after_a_divergence"] = sum(1 for r in ok if key(r) in ref_prompt and key(r) not in same)
        divs = compare_streams({key(r): r.output for r in ref if key(r) in same},
                               {key(r): r.output for r in ok if key(r) in same},
                               {key(r): r.top2_gaps for r in ref}, ref_prompt, lm, strict=False, verbose=False)
        row["divergences"] = len(divs)
        row["divergence_details"] = [
            {"conversation": d.key[0], "turn": d.key[1], "token": d.index, "top2_logit_gap": round(d.logit_gap, 6),
             "indexer_gap": None if d.index_gap is None else round(d.index_gap, 6), "accepted_by": d.accepted_by}
            for d in divs]
        unexplained = [x for x in divs if x.accepted_by is None]
        # What was compared, exactly: strict equality of every turn, or equality under the rule
        # with N accepted divergences and M turns left uncompared (their prompts differ).
        row["equal_under_rule"] = not unexplained and row["errors"] == 0
        row["greedy_identical"] = row["equal_under_rule"] and not divs and not row["turns_after_a_divergence"]
        row["equality"] = (
            f"{len(unexplained)} unexplained divergence(s), {row['errors']} error(s)" if not row["equal_under_rule"]
            else "strict: every turn identical" if row["greedy_identical"]
            else f"under the rule: {len(divs)} accepted divergence(s), "
                 f"{row['turns_after_a_divergence']} turn(s) not compared")
    return row


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in MODES:
        pts = sorted((r for r in rows if r["mode"] == mode and r["interactivity"]), key=lambda r: r["concurrency"])
        if not pts:
            continue
        a.plot([r["logical_throughput_tok_s"] for r in pts], [r["interactivity"] for r in pts], "o-", label=mode)
        for r in pts:
            a.annotate(f"c{r['concurrency']}", (r["logical_throughput_tok_s"], r["interactivity"]), fontsize=7)
        b.plot([r["concurrency"] for r in pts], [r["mean_running"] for r in pts], "o-", label=f"{mode} measured")
        b.plot([r["concurrency"] for r in pts], [r["predicted_running"] for r in pts], "x--", alpha=0.6,
               label=f"{mode} planner")
    a.set_xlabel("logical throughput (tokens/s per device, cached prompt tokens included)")
    a.set_ylabel("interactivity (1000 / mean TPOT ms)")
    a.set_title("interactivity vs throughput")
    a.legend()
    b.set_xlabel("concurrency")
    b.set_ylabel("non-zero mean of num_requests_running")
    b.set_title("running requests")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="--scale 32 --concurrency 1,4,10 (under 15 min on 2 cores)")
    p.add_argument("--scale", type=float, default=16, help="divide the reference token counts by this")
    p.add_argument("--turns", type=int, default=13)
    p.add_argument("--concurrency", default="1,8,16,24,32")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--layout", default="1", choices=list(LAYOUTS),
                   help="parallel layout of every server (8 simulated CPU devices when > 1); host budgets "
                        "are per data-parallel replica (HiSparse's pool and every connector's store)")
    p.add_argument("--baseline-contexts", type=int, default=2,
                   help="the small pool (preemption and hisparse) holds this many final contexts fully resident")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default 32,768 / scale (the reference's chunk, scaled like the turns)")
    p.add_argument("--hisparse-config", default="{}", help="extra hisparse_config keys (JSON)")
    p.add_argument("--scrape-s", type=float, default=0.25)
    p.add_argument("--low-repeats", type=int, default=5, help="runs of each point with concurrency <= 2")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.concurrency = 32, "1,4,10"
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = chunk_tokens(args.scale)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    concs = [int(c) for c in args.concurrency.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    wl = Workload.scaled(args.scale, args.turns)
    cache_dtype = "float32" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    dcp, dp = layout_sizes(args.layout)
    cfg, layout, per, small, ample = pool_sizes(wl, args.baseline_contexts, max(concs), cache_dtype, dcp)
    mla = layout.group("mla")
    host = host_budget(wl, max(concs), cfg, mla, json.loads(args.hisparse_config), args.max_num_batched_tokens, dcp)
    hs, host_total, host_blocks = host["hs"], host["host_total"], host["host_blocks"]

    def connector(nbytes: int) -> list[str]:
        return ["--kv-transfer-config", json.dumps(offload_connector(nbytes))]

    max_num_seqs = max(max(concs), 2)
    max_len = wl.final_context + 64
    print(f"workload: {wl} -> final context {wl.final_context} tokens = {per} pages; pools: small {small} "
          f"pages, ample {ample}; hisparse_config {hs}; host budget {host_total / 2**20:.1f} MiB", flush=True)
    common = ["--max-model-len", str(max_len), "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching",
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-dtype", args.kv_cache_dtype,
              "--disable-log-stats", *LAYOUTS[args.layout]]
    flags = {"ample": ["--num-gpu-blocks-override", str(ample)],
             "preemption": ["--num-gpu-blocks-override", str(small)],
             "offload": ["--num-gpu-blocks-override", str(small), *connector(host_total)],
             "hisparse": ["--num-gpu-blocks-override", str(small), "--attention-config",
                          json.dumps({"hisparse_config": hs}),
                          *connector(host_total // 4)]}
    vocab = 400  # the tiny tokenizer's ordinary ids lie below its special tokens
    rows, refs = [], {}
    lm = None  # the model for the equality rule's indexer diagnostic (loaded once, for the compared modes)

    def equality_model():
        nonlocal lm
        if lm is None:
            from glm53 import api

            lm = api.load(cache_dtype=cache_dtype)
        return lm

    for mode in (["ample"] if "ample" in modes else []) + [m for m in modes if m != "ample"]:
        server = Server(common + flags[mode], out / f"server_{mode}.log")
        print(f"{mode}: server healthy after {server.startup_s:.0f} s", flush=True)
        try:
            # Warm-up (not measured): one short conversation, so that first-use costs (page
            # faults, lazily built callables) do not land in the first point.
            run_point(server, Workload(wl.first, wl.later, wl.out, 2), 1, vocab, False, args.scrape_s, 10_000)
            offset = 0
            for c in concs:
                nb = small if mode != "ample" else ample
                pred = predicted(mode, layout, nb, wl, host["planner"], c, max_num_seqs, host_blocks, dcp, dp)
                # A point of c ≤ 2 lasts seconds: it is run `--low-repeats` times (new
                # conversations each time, so no run reuses another's prefixes) and the run with
                # the median logical throughput is reported.
                runs = []
                for _ in range(args.low_repeats if c <= 2 else 1):
                    results, samples, before, after, wall = run_point(server, wl, c, vocab, mode == "ample",
                                                                      args.scrape_s, offset)
                    offset += 2 * c
                    (out / f"samples_{mode}_c{c}.json").write_text(json.dumps(
                        {"scrape_s": args.scrape_s, "running_waiting": samples}))
                    if mode == "ample":
                        refs.setdefault(c, []).extend(results)
                    runs.append(summarize(mode, c, results, samples, before, after, wall, pred,
                                          [r for r in refs.get(c, []) if (r.conv, r.turn) in
                                           {(x.conv, x.turn) for x in results}] if mode != "ample" else None,
                                          lm=equality_model() if mode != "ample" else None))
                runs.sort(key=lambda r: r["logical_throughput_tok_s"])
                row = dict(runs[len(runs) // 2], repeats=len(runs))
                if mode != "ample" and runs[0]["equal_under_rule"] is not None:
                    row["greedy_identical"] = all(r["greedy_identical"] for r in runs)
                    row["equal_under_rule"] = all(r["equal_under_rule"] for r in runs)
                    row["equality"] = "; ".join(r["equality"] for r in runs)  # one per repeat
                if mode == "ample":
                    row["greedy_identical"] = row["equal_under_rule"] = row["errors"] == 0
                    row["equality"] = "the reference"
                rows.append(row)
                print(json.dumps(row), flush=True)
                (out / "summary.json").write_text(json.dumps(rows, indent=1))
        finally:
            server.stop()
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "agentic.png")
    cols = ("mode", "concurrency", "mean_running", "mean_running_while_waiting", "share_waiting", "predicted_running",
            "logical_throughput_tok_s", "interactivity",
            "agentx_tok_s_per_user", "ttft_p50_s", "ttft_p90_s", "preemptions", "hot_hit_rate", "h2d_bytes",
            "equality")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c)) for c in cols))
    print(f"wrote {out / 'summary.json'}, {out / 'summary.csv'}, {out / 'agentic.png'}")
    return rows


if __name__ == "__main__":
    main()
